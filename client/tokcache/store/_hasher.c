/* ``Hasher``: SHA-256 in C (libcrypto), the subset of ``hashlib.sha256`` that keys use
 * (``update``, ``copy``, ``digest``), with the same digests (see _hasher.h).
 *
 * Why not hashlib's object: a key pass makes ~8 calls per request into the hasher, and
 * hashlib lets go of the GIL for an update of 2 KB or more; getting it back then waits for
 * whichever of the caller's threads took it meanwhile (gRPC's, an application's) for
 * up to the interpreter's switch interval (5 ms), for hashing that takes microseconds. This
 * one never lets it go: SHA-256 runs at ~1.5 GB/s here (SHA-NI), so even an 8 MB text holds
 * it for ~5 ms, one switch interval. Its state is also what the engine extension's key pass
 * works on in place (hashlib's is opaque).
 */
#define PY_SSIZE_T_CLEAN
#include "_hasher.h"

#include <string.h>

static PyTypeObject HasherType;

static TkHasher *api_wrap(const TkHashState *state) {
    TkHasher *c = (TkHasher *)HasherType.tp_alloc(&HasherType, 0);
    if (c) c->state = *state;
    return c;
}

static void api_update(TkHashState *state, const void *data, size_t n) {
    SHA256_Update(state, data, n);
}

static void api_finalize(const TkHashState *state, uint8_t *out, size_t n) {
    /* SHA256_Final pads and ends its context: it works on a copy. */
    TkHashState t = *state;
    uint8_t md[TK_DIGEST_SIZE];
    SHA256_Final(md, &t);
    memcpy(out, md, n < TK_DIGEST_SIZE ? n : TK_DIGEST_SIZE);
}

/* Feed a buffer-protocol object (bytes, bytearray, memoryview, ...). */
static int feed_object(TkHasher *h, PyObject *data) {
    if (PyUnicode_Check(data)) { /* as hashlib: text must be encoded first */
        PyErr_SetString(PyExc_TypeError, "Strings must be encoded before hashing");
        return -1;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(data, &view, PyBUF_SIMPLE) < 0) return -1;
    SHA256_Update(&h->state, view.buf, (size_t)view.len);
    PyBuffer_Release(&view);
    return 0;
}

static PyObject *Hasher_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    PyObject *data = NULL;
    static char *kwlist[] = {"data", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|O:Hasher", kwlist, &data)) return NULL;
    TkHasher *h = (TkHasher *)type->tp_alloc(type, 0);
    if (!h) return NULL;
    SHA256_Init(&h->state);
    if (data && data != Py_None && feed_object(h, data) < 0) {
        Py_DECREF(h);
        return NULL;
    }
    return (PyObject *)h;
}

PyDoc_STRVAR(update_doc, "update(data, /) -> None\n\nFeed the bytes of a buffer (bytes, bytearray, memoryview).");

static PyObject *Hasher_update(TkHasher *self, PyObject *data) {
    if (feed_object(self, data) < 0) return NULL;
    Py_RETURN_NONE;
}

PyDoc_STRVAR(copy_doc, "copy() -> Hasher\n\nA new hasher in the same state (this one is unchanged).");

static PyObject *Hasher_copy(TkHasher *self, PyObject *Py_UNUSED(ignored)) {
    return (PyObject *)api_wrap(&self->state);
}

PyDoc_STRVAR(digest_doc,
"digest() -> bytes\n\nThe 32-byte SHA-256 digest of what was fed so far. Does not finalize: feeding more after\n"
"is fine.");

static PyObject *Hasher_digest(TkHasher *self, PyObject *Py_UNUSED(ignored)) {
    PyObject *out = PyBytes_FromStringAndSize(NULL, TK_DIGEST_SIZE);
    if (out) api_finalize(&self->state, (uint8_t *)PyBytes_AS_STRING(out), TK_DIGEST_SIZE);
    return out;
}

PyDoc_STRVAR(hexdigest_doc, "hexdigest() -> str\n\n``digest().hex()``.");

static PyObject *Hasher_hexdigest(TkHasher *self, PyObject *Py_UNUSED(ignored)) {
    PyObject *raw = Hasher_digest(self, NULL);
    if (!raw) return NULL;
    PyObject *hex = PyObject_CallMethod(raw, "hex", NULL);
    Py_DECREF(raw);
    return hex;
}

static PyMethodDef Hasher_methods[] = {
    {"update", (PyCFunction)Hasher_update, METH_O, update_doc},
    {"copy", (PyCFunction)Hasher_copy, METH_NOARGS, copy_doc},
    {"digest", (PyCFunction)Hasher_digest, METH_NOARGS, digest_doc},
    {"hexdigest", (PyCFunction)Hasher_hexdigest, METH_NOARGS, hexdigest_doc},
    {NULL, NULL, 0, NULL},
};

PyDoc_STRVAR(Hasher_doc,
"Hasher(data=None)\n\nSHA-256 (OpenSSL's libcrypto; the digests of hashlib.sha256), holding the GIL\n"
"throughout. Not thread-safe: one thread feeds one hasher.");

static PyTypeObject HasherType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "tokcache.store._speedups.Hasher",
    .tp_basicsize = sizeof(TkHasher),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = Hasher_doc,
    .tp_methods = Hasher_methods,
    .tp_new = Hasher_new,
};

static TkHasherAPI api = {TK_HASHER_API_VERSION, &HasherType, api_wrap, api_update, api_finalize};

int tk_hasher_add(PyObject *m) {
    if (PyType_Ready(&HasherType) < 0) return -1;
    Py_INCREF(&HasherType);
    if (PyModule_AddObject(m, "Hasher", (PyObject *)&HasherType) < 0) {
        Py_DECREF(&HasherType);
        return -1;
    }
    PyObject *capsule = PyCapsule_New(&api, TK_HASHER_CAPSULE, NULL);
    if (!capsule) return -1;
    if (PyModule_AddObject(m, "_hasher_api", capsule) < 0) {
        Py_DECREF(capsule);
        return -1;
    }
    return 0;
}

void tk_record_check(const void *data, size_t n, uint8_t out[16]) {
    /* (not the one-shot SHA256(): in OpenSSL 3 it fetches the algorithm on every call) */
    TkHashState h;
    uint8_t md[TK_DIGEST_SIZE];
    SHA256_Init(&h);
    SHA256_Update(&h, data, n);
    SHA256_Final(md, &h);
    memcpy(out, md, 16);
}
