/* The key hasher shared by both C extensions: SHA-256 from OpenSSL's libcrypto (the library
 * CPython's hashlib links) as a Python type, ``tokcache.store._speedups.Hasher``.
 *
 * tokcache.store._speedups defines the type and exports this API in a capsule
 * (TK_HASHER_CAPSULE); tokcache.engine._speedups imports it, so its key pass works on
 * the hashers' state directly (no call into Python per update, copy or digest) and
 * both modules agree on one type. Digests equal ``hashlib.sha256``'s
 * (tests/tokcache/store/test_hasher.py): keys written by either are the same.
 *
 * The state is OpenSSL's low-level SHA256_CTX, deprecated since OpenSSL 3 in favour of EVP
 * but still exported: a key is the digest of a running hash at every keyed cut, without
 * finalizing it, so the hash is copied once per key. A SHA256_CTX is a 112-byte plain struct
 * (copied by assignment, on the stack); an EVP_MD_CTX is opaque and heap-allocated, and
 * EVP_MD_CTX_copy_ex + EVP_DigestFinal_ex measured ~1.7x the time of a struct copy +
 * SHA256_Final, for the same block function (SHA-NI where the CPU has it).
 */
#ifndef TK_HASHER_H
#define TK_HASHER_H

#include <Python.h>
#include <stdint.h>

#ifndef OPENSSL_SUPPRESS_DEPRECATED
#define OPENSSL_SUPPRESS_DEPRECATED /* SHA256_Init/Update/Final: see above */
#endif
#include <openssl/sha.h>

/* Plain data: copy one to a local to hash on from it. */
typedef SHA256_CTX TkHashState;

#define TK_DIGEST_SIZE SHA256_DIGEST_LENGTH

typedef struct {
    PyObject_HEAD
    TkHashState state;
} TkHasher;

typedef struct {
    int version; /* TK_HASHER_API_VERSION */
    PyTypeObject *type;
    /* A new Hasher holding a copy of ``state`` (NULL and an exception on failure). */
    TkHasher *(*wrap)(const TkHashState *state);
    /* Feed ``n`` bytes (no Python, no GIL release). */
    void (*update)(TkHashState *state, const void *data, size_t n);
    /* The first ``n`` (<= TK_DIGEST_SIZE) bytes of the digest of what was fed so far;
     * ``state`` is unchanged. */
    void (*finalize)(const TkHashState *state, uint8_t *out, size_t n);
} TkHasherAPI;

#define TK_HASHER_CAPSULE "tokcache.store._speedups._hasher_api"
#define TK_HASHER_API_VERSION 2 /* 2: SHA-256 (1 was BLAKE3) */

/* (tokcache.store._speedups only) Add ``Hasher`` and the capsule to module ``m``: 0, or -1 with an exception. */
int tk_hasher_add(PyObject *m);

/* (tokcache.store._speedups only) A record's check: the first 16 bytes of the digest of
 * ``data[:n]`` (_layout.check_of). */
void tk_record_check(const void *data, size_t n, uint8_t out[16]);

#endif
