/* The index format in C: bucket geometry and the probe, for the extensions that read a
 * segment's index (tokcache.store._speedups, tokcache.engine._speedups). _layout.py owns the
 * format and _index.py is the reference; these must say the same (tests compare them).
 */
#ifndef TOKCACHE_INDEX_H
#define TOKCACHE_INDEX_H

#include <stdint.h>
#include <string.h>

#define TK_KEY_SIZE 16
#define TK_BUCKET_SLOTS 15
#define TK_SLOTS_OFF 32
#define TK_SLOT_SIZE 32
#define TK_BUCKET_SIZE (TK_SLOTS_OFF + TK_SLOT_SIZE * TK_BUCKET_SLOTS)
#define TK_LSN_MASK ((((uint64_t)1) << 56) - 1)

static inline uint64_t tk_load_u64(const unsigned char *p) {
    uint64_t v;
    memcpy(&v, p, 8); /* little-endian hosts only: checked at each module's import */
    return v;
}

static inline uint32_t tk_load_u32(const unsigned char *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* The key's two bucket numbers: (key as a little-endian 128-bit integer) mod n, and its
 * high 64 bits mod n -- exactly Index._bucket_offs. */
static inline void tk_buckets(const unsigned char *key, uint64_t n, uint64_t *b1, uint64_t *b2) {
    uint64_t lo = tk_load_u64(key), hi = tk_load_u64(key + 8);
    unsigned __int128 h = ((unsigned __int128)hi << 64) | lo;
    *b1 = (uint64_t)(h % n);
    *b2 = hi % n;
}

/* Offset (from the start of the index) of key's slot, or -1. */
static inline int64_t tk_find_slot(const unsigned char *index, uint64_t n_buckets, const unsigned char *key) {
    unsigned char tag = key[7] ^ key[15];
    if (!tag) tag = 1;
    uint64_t b[2];
    tk_buckets(key, n_buckets, &b[0], &b[1]);
    for (int k = 0; k < 2; k++) {
        if (k == 1 && b[1] == b[0]) break;
        const unsigned char *bucket = index + b[k] * TK_BUCKET_SIZE;
        for (int i = 0; i < TK_BUCKET_SLOTS; i++) {
            if (bucket[i] == tag && memcmp(bucket + TK_SLOTS_OFF + i * TK_SLOT_SIZE, key, TK_KEY_SIZE) == 0)
                return (int64_t)(b[k] * TK_BUCKET_SIZE + TK_SLOTS_OFF + i * TK_SLOT_SIZE);
        }
    }
    return -1;
}

/* Whether the slot at ``slot`` is unexpired at ``now`` and points at or above ``tail``. */
static inline int tk_slot_live(const unsigned char *slot, double now, uint64_t tail) {
    uint64_t lsn_kind = tk_load_u64(slot + TK_KEY_SIZE);
    uint32_t expiry = tk_load_u32(slot + TK_KEY_SIZE + 8);
    return (expiry == 0 || now < (double)expiry) && (lsn_kind & TK_LSN_MASK) >= tail;
}

#endif
