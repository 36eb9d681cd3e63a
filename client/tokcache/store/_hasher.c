/* ``Hasher``: BLAKE3 in C, the subset of the ``blake3`` package's hasher that keys use
 * (``update``, ``copy``, ``digest``), with the same digests (see _hasher.h).
 *
 * Why not the package: a key pass makes ~8 calls into its binding per request (~23 us of a
 * cold read's lookup), and the binding lets go of the GIL for an update of 2 KB or more,
 * so a 57 KB text was fed in pieces below that (tokcache.store._hash: 89 us instead of 22)
 * to not wait up to a switch interval (5 ms) for the GIL after. This one never lets it go:
 * BLAKE3 runs at GB/s here, so even an 8 MB text holds it for a few ms, about one switch
 * interval, and a request does not pay a GIL hand-off for microseconds of hashing.
 */
#define PY_SSIZE_T_CLEAN
#include "_hasher.h"

#include <string.h>

static PyTypeObject HasherType;

static TkHasher *hasher_new_empty(void) {
    return (TkHasher *)HasherType.tp_alloc(&HasherType, 0);
}

static TkHasher *api_wrap(const blake3_hasher *state) {
    TkHasher *c = hasher_new_empty();
    if (c) memcpy(&c->state, state, sizeof(blake3_hasher));
    return c;
}

static void api_update(blake3_hasher *state, const void *data, size_t n) {
    blake3_hasher_update(state, data, n);
}

static void api_finalize(const blake3_hasher *state, uint8_t *out, size_t n) {
    blake3_hasher_finalize(state, out, n);
}

/* Feed a buffer-protocol object (bytes, bytearray, memoryview, ...). */
static int feed_object(TkHasher *h, PyObject *data) {
    if (PyUnicode_Check(data)) { /* as the package: text must be encoded first */
        PyErr_SetString(PyExc_TypeError, "Unicode-objects must be encoded before hashing");
        return -1;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(data, &view, PyBUF_SIMPLE) < 0) return -1;
    blake3_hasher_update(&h->state, view.buf, (size_t)view.len);
    PyBuffer_Release(&view);
    return 0;
}

static PyObject *Hasher_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    PyObject *data = NULL;
    static char *kwlist[] = {"data", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|O:Hasher", kwlist, &data)) return NULL;
    TkHasher *h = (TkHasher *)type->tp_alloc(type, 0);
    if (!h) return NULL;
    blake3_hasher_init(&h->state);
    if (data && data != Py_None && feed_object(h, data) < 0) {
        Py_DECREF(h);
        return NULL;
    }
    return (PyObject *)h;
}

PyDoc_STRVAR(update_doc, "update(data, /) -> self\n\nFeed the bytes of a buffer (bytes, bytearray, memoryview).");

static PyObject *Hasher_update(TkHasher *self, PyObject *data) {
    if (feed_object(self, data) < 0) return NULL;
    return Py_NewRef((PyObject *)self);
}

PyDoc_STRVAR(copy_doc, "copy() -> Hasher\n\nA new hasher in the same state (this one is unchanged).");

static PyObject *Hasher_copy(TkHasher *self, PyObject *Py_UNUSED(ignored)) {
    return (PyObject *)api_wrap(&self->state);
}

PyDoc_STRVAR(digest_doc,
"digest(length=32) -> bytes\n\nThe first ``length`` bytes of BLAKE3's output for what was fed so far\n"
"(extendable output: any length >= 1 up to 1 MiB). Does not finalize: feeding more after is fine.");

#define TK_DIGEST_MAX (1 << 20)

static PyObject *Hasher_digest(TkHasher *self, PyObject *args, PyObject *kwds) {
    Py_ssize_t length = BLAKE3_OUT_LEN;
    static char *kwlist[] = {"length", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|n:digest", kwlist, &length)) return NULL;
    if (length < 1 || length > TK_DIGEST_MAX) {
        PyErr_Format(PyExc_ValueError, "digest length must be 1 to %d bytes, not %zd", TK_DIGEST_MAX, length);
        return NULL;
    }
    PyObject *out = PyBytes_FromStringAndSize(NULL, length);
    if (!out) return NULL;
    blake3_hasher_finalize(&self->state, (uint8_t *)PyBytes_AS_STRING(out), (size_t)length);
    return out;
}

PyDoc_STRVAR(hexdigest_doc, "hexdigest(length=32) -> str\n\n``digest(length).hex()``.");

static PyObject *Hasher_hexdigest(TkHasher *self, PyObject *args, PyObject *kwds) {
    PyObject *raw = Hasher_digest(self, args, kwds);
    if (!raw) return NULL;
    PyObject *hex = PyObject_CallMethod(raw, "hex", NULL);
    Py_DECREF(raw);
    return hex;
}

static PyMethodDef Hasher_methods[] = {
    {"update", (PyCFunction)Hasher_update, METH_O, update_doc},
    {"copy", (PyCFunction)Hasher_copy, METH_NOARGS, copy_doc},
    {"digest", (PyCFunction)(void (*)(void))Hasher_digest, METH_VARARGS | METH_KEYWORDS, digest_doc},
    {"hexdigest", (PyCFunction)(void (*)(void))Hasher_hexdigest, METH_VARARGS | METH_KEYWORDS, hexdigest_doc},
    {NULL, NULL, 0, NULL},
};

PyDoc_STRVAR(Hasher_doc,
"Hasher(data=None)\n\nBLAKE3 (the official C implementation; the same digests as the blake3 package's\n"
"hasher), holding the GIL throughout. Not thread-safe: one thread feeds one hasher.");

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
    blake3_hasher h;
    blake3_hasher_init(&h);
    blake3_hasher_update(&h, data, n);
    blake3_hasher_finalize(&h, out, 16);
}
