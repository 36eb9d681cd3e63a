/* The key hasher shared by both C extensions: BLAKE3 (the vendored official C
 * implementation, _blake3/) as a Python type, ``tokcache.store._speedups.Hasher``.
 *
 * tokcache.store._speedups defines the type and exports this API in a capsule
 * (TK_HASHER_CAPSULE); tokcache.engine._speedups imports it, so its key pass works on
 * the hashers' state directly (no call into a binding per update, copy or digest) and
 * both modules agree on one type and one implementation. Digests equal the ``blake3``
 * package's (tests/tokcache/store/test_hasher.py): keys written by either are the same.
 */
#ifndef TK_HASHER_H
#define TK_HASHER_H

#include <Python.h>
#include <stdint.h>

#include "_blake3/blake3.h"

typedef struct {
    PyObject_HEAD
    blake3_hasher state;
} TkHasher;

typedef struct {
    int version; /* TK_HASHER_API_VERSION */
    PyTypeObject *type;
    /* A new Hasher holding a copy of ``state`` (NULL and an exception on failure). A state is
     * plain data: copy one (a TkHasher's ``state``) to a local to hash on from it. */
    TkHasher *(*wrap)(const blake3_hasher *state);
    /* Feed ``n`` bytes (blake3_hasher_update; no Python, no GIL release). */
    void (*update)(blake3_hasher *state, const void *data, size_t n);
    /* The first ``n`` bytes of the digest of what was fed so far; ``state`` is unchanged. */
    void (*finalize)(const blake3_hasher *state, uint8_t *out, size_t n);
} TkHasherAPI;

#define TK_HASHER_CAPSULE "tokcache.store._speedups._hasher_api"
#define TK_HASHER_API_VERSION 1

/* (tokcache.store._speedups only) Add ``Hasher`` and the capsule to module ``m``: 0, or -1 with an exception. */
int tk_hasher_add(PyObject *m);

/* (tokcache.store._speedups only) A record's check: the first 16 bytes of the digest of
 * ``data[:n]`` (_layout.check_of). */
void tk_record_check(const void *data, size_t n, uint8_t out[16]);

#endif
