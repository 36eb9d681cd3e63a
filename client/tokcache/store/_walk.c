/* A chain walk in C: Log.walk_known (_log.py, the reference: the tests compare the two).
 *
 * A read of a conversation another process extended since this one last saw it walks the
 * records written meanwhile, a few per turn: each copied out of the segment (pread, never
 * through the mapping: see _log.py), verified (magic, own LSN, check, link to its parent)
 * and its ids taken. In Python each record cost ~10 us of interpreter work around a few
 * hundred nanoseconds of copying and hashing.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "_hasher.h"
#include "_walk.h"

/* _layout.py's record format (RECORD: "<16sIIQQ8sIIIHBBIIQ", ENTRY: "<16sIIB3x"). */
#define W_HEAD 32
#define W_TAIL 33
#define RECORD_SIZE 80
#define ENTRY_SIZE 28
#define CHECK_SIZE 16
#define LINK_CHECK_SIZE 8
#define KEY_SIZE 16
#define MIN_RECORD ((RECORD_SIZE + ENTRY_SIZE + 7) & ~7)
#define RECORD_MAGIC 0x31524B54u /* "TKR1" little-endian */
#define F_HAS_PARENT 1
#define LSN_BITS 56
#define LSN_MASK ((((uint64_t)1) << LSN_BITS) - 1)
#define EVICTED 1
#define CORRUPT 2

static inline uint64_t u64_at(const unsigned char *p) {
    uint64_t v;
    memcpy(&v, p, 8);
    return v;
}

static inline uint32_t u32_at(const unsigned char *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* pread all of ``n`` bytes at ``off``; a short read (past the end of the file) is padded with
 * zeros, as Log._read pads it: a failed check. 0, or -1 with OSError set. */
static int read_at(int fd, unsigned char *buf, size_t n, uint64_t off) {
    size_t got = 0;
    while (got < n) {
        ssize_t r = pread(fd, buf + got, n - got, (off_t)(off + got));
        if (r < 0) {
            if (errno == EINTR) continue;
            PyErr_SetFromErrno(PyExc_OSError);
            return -1;
        }
        if (r == 0) {
            memset(buf + got, 0, n - got);
            return 0;
        }
        got += (size_t)r;
    }
    return 0;
}

PyDoc_STRVAR(walk_doc,
"walk(fd, arena_off, arena_size, id_bytes, words, key, lsn_kind, known, max_chain) -> tuple | int\n\n"
"Log.walk_known: ``key``'s chain from the record at ``lsn_kind``, stopping at the first record\n"
"``known(lsn, check8)`` (None: no such callable) says the caller holds. ``words``: the header as a\n"
"buffer of u64 words (tail and head are read from it). Returns (rest, oldest, depth,\n"
"key_expiry, chain_expiry, (lsn, check8, base, n, floor), held, held_tokens, keys) with ``rest`` the\n"
"stored ids (``id_bytes`` wide) after the held ones and ``keys`` every chain key of the key's own\n"
"record ({key: ids of the record it uses}), or 1 (evicted) / 2 (corrupt). A chain of more than\n"
"``max_chain`` records is corrupt.");

static PyObject *py_walk(PyObject *self, PyObject *args) {
    (void)self;
    int fd, id_bytes;
    unsigned long long arena_off, arena_size, lsn_kind;
    PyObject *words_obj, *known;
    Py_buffer key, words;
    Py_ssize_t max_chain;
    if (!PyArg_ParseTuple(args, "iKKiOy*KOn", &fd, &arena_off, &arena_size, &id_bytes, &words_obj, &key, &lsn_kind,
                          &known, &max_chain))
        return NULL;
    if (PyObject_GetBuffer(words_obj, &words, PyBUF_SIMPLE) < 0) {
        PyBuffer_Release(&key);
        return NULL;
    }
    PyObject *result = NULL, *own = NULL, *held = NULL, *check8 = NULL, *keys = NULL;
    /* The copied records (newest first) and where their taken ids are: grown as the walk goes. */
    unsigned char **recs = NULL;
    Py_ssize_t *from = NULL, *len = NULL;
    Py_ssize_t n_parts = 0, cap = 0;
    const unsigned char *w = (const unsigned char *)words.buf;
    if (key.len != KEY_SIZE || words.len < 8 * (W_TAIL + 1) || arena_size < MIN_RECORD ||
        (id_bytes != 3 && id_bytes != 4)) {
        PyErr_SetString(PyExc_ValueError, "walk: bad arguments");
        goto done;
    }
    uint64_t tail = u64_at(w + 8 * W_TAIL);
    uint64_t cur = lsn_kind & LSN_MASK;
    unsigned kind = (unsigned)(lsn_kind >> LSN_BITS);
    long long n = -1; /* ids to take from the current record; -1: from its entry for ``key`` */
    uint32_t start = 0; /* the key's first id in its own record (a segment entry's) */
    uint64_t expect_base = 0, end = 0, held_tokens = 0;
    unsigned char expect_check[LINK_CHECK_SIZE];
    uint32_t key_expiry = 0, chain_expiry = 0;
    Py_ssize_t depth = 0;
    int fail = 0; /* 0, or why the walk failed: EVICTED / CORRUPT */
#define FAILED(lsn) \
    do { \
        fail = (lsn) < u64_at(w + 8 * W_TAIL) ? EVICTED : CORRUPT; \
        goto out; \
    } while (0)
    if (cur < tail) {
        fail = EVICTED; /* before touching its bytes: their page may have been given back */
        goto out;
    }
    uint64_t pos = cur % arena_size;
    if (pos + MIN_RECORD > arena_size) FAILED(cur);
    unsigned char szb[4];
    if (read_at(fd, szb, 4, arena_off + pos + 20) < 0) goto done;
    uint64_t size = u32_at(szb);
    for (;;) {
        if (cur < tail) {
            fail = EVICTED;
            goto out;
        }
        depth++;
        pos = cur % arena_size;
        if (depth > max_chain || size < MIN_RECORD || pos + size > arena_size) FAILED(cur);
        if (n_parts == cap) {
            Py_ssize_t grown = cap ? 2 * cap : 8;
            unsigned char **r2 = realloc(recs, (size_t)grown * sizeof *recs);
            if (r2) recs = r2;
            Py_ssize_t *f2 = r2 ? realloc(from, (size_t)grown * sizeof *from) : NULL;
            if (f2) from = f2;
            Py_ssize_t *l2 = f2 ? realloc(len, (size_t)grown * sizeof *len) : NULL;
            if (l2) len = l2;
            if (!l2) {
                PyErr_NoMemory();
                goto done;
            }
            cap = grown;
        }
        unsigned char *rec = malloc(size);
        if (!rec) {
            PyErr_NoMemory();
            goto done;
        }
        recs[n_parts] = rec; /* owned from here (freed at the end, taken or not) */
        from[n_parts] = len[n_parts] = 0;
        n_parts++;
        if (read_at(fd, rec, size, arena_off + pos) < 0) goto done;
        uint32_t magic = u32_at(rec + 16), size2 = u32_at(rec + 20);
        uint64_t own_lsn = u64_at(rec + 24), parent_lsn = u64_at(rec + 32), floor = u64_at(rec + 72);
        uint32_t parent_n = u32_at(rec + 48), base = u32_at(rec + 52), n_ids = u32_at(rec + 56);
        uint32_t n_entries = (uint32_t)rec[60] | ((uint32_t)rec[61] << 8);
        unsigned flags = rec[63];
        uint32_t expiry = u32_at(rec + 64), parent_size = u32_at(rec + 68);
        unsigned char check[CHECK_SIZE];
        if (magic != RECORD_MAGIC || own_lsn != cur || size2 != size) FAILED(cur);
        tk_record_check(rec + CHECK_SIZE, size - CHECK_SIZE, check);
        if (memcmp(check, rec, CHECK_SIZE) != 0) FAILED(cur);
        uint64_t ids_off = RECORD_SIZE + (uint64_t)ENTRY_SIZE * n_entries;
        if (ids_off + (uint64_t)id_bytes * n_ids > size) FAILED(cur);
        if (n < 0) {
            uint64_t q = RECORD_SIZE;
            for (; q < ids_off; q += ENTRY_SIZE)
                if (memcmp(rec + q, key.buf, KEY_SIZE) == 0) break;
            if (q >= ids_off) FAILED(cur);
            n = u32_at(rec + q + 16);
            key_expiry = u32_at(rec + q + 20);
            start = (uint32_t)rec[q + 25] | (uint32_t)rec[q + 26] << 8 | (uint32_t)rec[q + 27] << 16;
            if (rec[q + 24] != kind) FAILED(cur);
            if (floor < tail) {
                fail = EVICTED; /* its oldest link is gone: do not bother walking */
                goto out;
            }
            end = cur + size;
            if ((uint64_t)n > n_ids || (start && ((flags & F_HAS_PARENT) || base || start >= (uint64_t)n))) FAILED(cur);
            check8 = PyBytes_FromStringAndSize((const char *)rec, LINK_CHECK_SIZE);
            if (!check8) goto done;
            own = Py_BuildValue("(KOkLK)", (unsigned long long)cur, check8, (unsigned long)base, n,
                                (unsigned long long)floor);
            if (!own) goto done;
            /* Every key the record holds for its chain (the memo then answers them all). */
            keys = PyDict_New();
            if (!keys) goto done;
            for (uint64_t e = RECORD_SIZE; e < ids_off; e += ENTRY_SIZE) {
                if (rec[e + 25] | rec[e + 26] | rec[e + 27]) continue; /* a segment entry */
                PyObject *kb = PyBytes_FromStringAndSize((const char *)rec + e, KEY_SIZE);
                PyObject *kn = kb ? PyLong_FromUnsignedLong(u32_at(rec + e + 16)) : NULL;
                if (!kn || PyDict_SetItem(keys, kb, kn) < 0) {
                    Py_XDECREF(kb);
                    Py_XDECREF(kn);
                    goto done;
                }
                Py_DECREF(kb);
                Py_DECREF(kn);
            }
            if (known != Py_None && !start) { /* (a segment entry is no chain prefix) */
                PyObject *got = PyObject_CallFunction(known, "KO", (unsigned long long)cur, check8);
                if (!got) goto done;
                Py_ssize_t g_base, g_n;
                if (got != Py_None && PyTuple_Check(got) && PyTuple_GET_SIZE(got) == 3 &&
                    (g_base = PyLong_AsSsize_t(PyTuple_GET_ITEM(got, 1))) == (Py_ssize_t)base &&
                    (g_n = PyLong_AsSsize_t(PyTuple_GET_ITEM(got, 2))) >= n) {
                    held = Py_NewRef(PyTuple_GET_ITEM(got, 0));
                    held_tokens = (uint64_t)base + (uint64_t)n;
                    Py_DECREF(got);
                    break;
                }
                Py_DECREF(got);
                if (PyErr_Occurred()) goto done;
            }
        } else if ((uint64_t)base + (uint64_t)n != expect_base || memcmp(rec, expect_check, LINK_CHECK_SIZE) != 0) {
            FAILED(cur);
        } else if (expiry && (!chain_expiry || expiry < chain_expiry)) {
            chain_expiry = expiry;
        }
        if ((uint64_t)n > n_ids) FAILED(cur);
        from[n_parts - 1] = (Py_ssize_t)(ids_off + (uint64_t)id_bytes * start);
        len[n_parts - 1] = (Py_ssize_t)(id_bytes * (n - (long long)start));
        start = 0;
        if (!(flags & F_HAS_PARENT)) {
            if (base) FAILED(cur);
            break;
        }
        if (parent_lsn >= cur) FAILED(cur); /* links only point backwards: no cycles */
        if (known != Py_None) {
            PyObject *pc = PyBytes_FromStringAndSize((const char *)rec + 40, LINK_CHECK_SIZE);
            if (!pc) goto done;
            PyObject *got = PyObject_CallFunction(known, "KO", (unsigned long long)parent_lsn, pc);
            Py_DECREF(pc);
            if (!got) goto done;
            Py_ssize_t g_base, g_n;
            if (got != Py_None && PyTuple_Check(got) && PyTuple_GET_SIZE(got) == 3 &&
                (g_base = PyLong_AsSsize_t(PyTuple_GET_ITEM(got, 1))) >= 0 &&
                (uint64_t)g_base + parent_n == base &&
                (g_n = PyLong_AsSsize_t(PyTuple_GET_ITEM(got, 2))) >= (Py_ssize_t)parent_n) {
                held = Py_NewRef(PyTuple_GET_ITEM(got, 0));
                held_tokens = base;
                Py_DECREF(got);
                break;
            }
            Py_DECREF(got);
            if (PyErr_Occurred()) goto done;
        }
        expect_base = base;
        memcpy(expect_check, rec + 40, LINK_CHECK_SIZE);
        n = parent_n;
        cur = parent_lsn;
        size = parent_size;
    }
    /* All copies are done: re-read tail (see _log.py). end > head means a corrupted head; treat
     * like eviction. */
    if (cur < u64_at(w + 8 * W_TAIL) || end > u64_at(w + 8 * W_HEAD)) {
        fail = EVICTED;
        goto out;
    }
out:
    if (fail) {
        result = PyLong_FromLong(fail);
        goto done;
    }
    {
        Py_ssize_t total = 0;
        for (Py_ssize_t i = 0; i < n_parts; i++) total += len[i];
        PyObject *rest = PyBytes_FromStringAndSize(NULL, total);
        if (!rest) goto done;
        char *dst = PyBytes_AS_STRING(rest);
        for (Py_ssize_t i = n_parts - 1; i >= 0; i--) { /* oldest first */
            if (len[i]) memcpy(dst, recs[i] + from[i], (size_t)len[i]);
            dst += len[i];
        }
        result = Py_BuildValue("(NKnkkOOKO)", rest, (unsigned long long)cur, depth, (unsigned long)key_expiry,
                               (unsigned long)chain_expiry, own, held ? held : Py_None,
                               (unsigned long long)held_tokens, keys);
    }
#undef FAILED
done:
    if (recs)
        for (Py_ssize_t i = 0; i < n_parts; i++) free(recs[i]);
    free(recs);
    free(from);
    free(len);
    Py_XDECREF(own);
    Py_XDECREF(held);
    Py_XDECREF(check8);
    Py_XDECREF(keys);
    PyBuffer_Release(&words);
    PyBuffer_Release(&key);
    return result;
}

PyMethodDef tk_walk_methods[] = {
    {"walk", py_walk, METH_VARARGS, walk_doc},
    {NULL, NULL, 0, NULL},
};
