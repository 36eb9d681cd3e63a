/* Token id sequences, in C, for recording an output.
 *
 * token_bytes: the bytes of a token id sequence, from a table of each token's bytes (one blob,
 * a u32 offset per id): a decode check in one pass over the ids, no Python object per id (a
 * 2000-token answer in a few microseconds). tokenbytes.py builds the table and holds the
 * Python reference (the tests compare the two).
 *
 * equal_ids: whether a caller's prompt ids are the ones a read served (kept as Chunks, see
 * ids.py): most items are the same int objects, compared by address. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "_pyint.h"
#include "_ids.h"

PyDoc_STRVAR(token_bytes_doc,
"token_bytes(blob, starts, present, ids, offsets) -> bytes | None\n\n"
"``ids`` (a list of ints) as the concatenation of their bytes, token ``i``'s being\n"
"``blob[starts[i]:starts[i + 1]]`` (``starts``: an array('I') one longer than ``present``);\n"
"with ``offsets`` instead the cumulative byte offset after each token, as packed u32.\n"
"None when an id has no token (outside the table, or ``present[i]`` is 0) or is no int.");

static PyObject *py_token_bytes(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer blob, starts, present;
    PyObject *ids;
    int offsets;
    if (!PyArg_ParseTuple(args, "y*y*y*O!p", &blob, &starts, &present, &PyList_Type, &ids, &offsets)) return NULL;
    PyObject *out = NULL;
    const uint32_t *st = (const uint32_t *)starts.buf;
    const unsigned char *have = (const unsigned char *)present.buf;
    Py_ssize_t n_tokens = present.len;
    if (starts.len != 4 * (n_tokens + 1) || (n_tokens && st[n_tokens] > (uint64_t)blob.len)) {
        PyErr_SetString(PyExc_ValueError, "token_bytes: the table's offsets do not fit its blob");
        goto done;
    }
    Py_ssize_t n = PyList_GET_SIZE(ids);
    /* First pass: every id has a token, and the total size. */
    uint64_t total = 0;
    for (Py_ssize_t k = 0; k < n; k++) {
        long v;
        if (!small_int(PyList_GET_ITEM(ids, k), &v) || v < 0 || v >= n_tokens || !have[v] || st[v + 1] < st[v]) {
            out = Py_None;
            Py_INCREF(out);
            goto done;
        }
        total += st[v + 1] - st[v];
    }
    if (offsets) {
        if (n > PY_SSIZE_T_MAX / 4 || total > UINT32_MAX) {
            out = Py_None;
            Py_INCREF(out);
            goto done;
        }
        out = PyBytes_FromStringAndSize(NULL, 4 * n);
        if (!out) goto done;
        uint32_t *dst = (uint32_t *)PyBytes_AS_STRING(out);
        uint32_t pos = 0;
        for (Py_ssize_t k = 0; k < n; k++) {
            long v;
            small_int(PyList_GET_ITEM(ids, k), &v);
            pos += st[v + 1] - st[v];
            dst[k] = pos;
        }
    } else {
        if (total > (uint64_t)PY_SSIZE_T_MAX) {
            PyErr_SetString(PyExc_OverflowError, "token_bytes: too many bytes");
            goto done;
        }
        out = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)total);
        if (!out) goto done;
        char *dst = PyBytes_AS_STRING(out);
        const char *src = (const char *)blob.buf;
        for (Py_ssize_t k = 0; k < n; k++) {
            long v;
            small_int(PyList_GET_ITEM(ids, k), &v);
            uint32_t a = st[v], len = st[v + 1] - a;
            memcpy(dst, src + a, len);
            dst += len;
        }
    }
done:
    PyBuffer_Release(&blob);
    PyBuffer_Release(&starts);
    PyBuffer_Release(&present);
    return out;
}

PyDoc_STRVAR(equal_ids_doc,
"equal_ids(ids, prefix, parts, n, suffix) -> bool\n\n"
"Whether the list ``ids`` equals ``prefix + <the first n ids of parts> + suffix``: ``parts`` as\n"
"Chunks hold them, a tuple of (list, how many of its first items), ``prefix`` and ``suffix``\n"
"tuples of ints. Items that are the same object are equal; others are compared as ints\n"
"(an item that is no int is unequal). ValueError when a part's length exceeds its list's.");

/* One item of ``ids`` against an expected int object: 1 equal, 0 not. */
static inline int same_id(PyObject *got, PyObject *want) {
    if (got == want) return 1;
    long a, b;
    if (small_int(got, &a) && small_int(want, &b)) return a == b;
    if (!PyLong_Check(got) || !PyLong_Check(want)) return 0;
    int r = PyObject_RichCompareBool(got, want, Py_EQ);
    if (r < 0) {
        PyErr_Clear();
        return 0;
    }
    return r;
}

static PyObject *py_equal_ids(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *ids, *prefix, *parts, *suffix;
    Py_ssize_t n;
    if (!PyArg_ParseTuple(args, "O!O!O!nO!", &PyList_Type, &ids, &PyTuple_Type, &prefix, &PyTuple_Type, &parts, &n,
                          &PyTuple_Type, &suffix))
        return NULL;
    Py_ssize_t np = PyTuple_GET_SIZE(prefix), ns = PyTuple_GET_SIZE(suffix);
    if (n < 0 || PyList_GET_SIZE(ids) != np + n + ns) Py_RETURN_FALSE;
    Py_ssize_t at = 0;
    for (Py_ssize_t k = 0; k < np; k++, at++)
        if (!same_id(PyList_GET_ITEM(ids, at), PyTuple_GET_ITEM(prefix, k))) Py_RETURN_FALSE;
    Py_ssize_t left = n;
    for (Py_ssize_t p = 0; p < PyTuple_GET_SIZE(parts) && left > 0; p++) {
        PyObject *part = PyTuple_GET_ITEM(parts, p);
        PyObject *ref;
        Py_ssize_t len;
        if (!PyTuple_Check(part) || PyTuple_GET_SIZE(part) != 2 || !PyList_Check(ref = PyTuple_GET_ITEM(part, 0))) {
            PyErr_SetString(PyExc_TypeError, "equal_ids: parts must be (list, int) pairs");
            return NULL;
        }
        len = PyLong_AsSsize_t(PyTuple_GET_ITEM(part, 1));
        if (len == -1 && PyErr_Occurred()) return NULL;
        if (len < 0 || len > PyList_GET_SIZE(ref)) {
            PyErr_SetString(PyExc_ValueError, "equal_ids: a part's length exceeds its list's");
            return NULL;
        }
        if (len > left) len = left;
        PyObject **a = ((PyListObject *)ids)->ob_item + at, **b = ((PyListObject *)ref)->ob_item;
        for (Py_ssize_t k = 0; k < len; k++)
            if (a[k] != b[k] && !same_id(a[k], b[k])) Py_RETURN_FALSE;
        at += len;
        left -= len;
    }
    if (left) Py_RETURN_FALSE; /* the parts hold fewer than n */
    for (Py_ssize_t k = 0; k < ns; k++, at++)
        if (!same_id(PyList_GET_ITEM(ids, at), PyTuple_GET_ITEM(suffix, k))) Py_RETURN_FALSE;
    Py_RETURN_TRUE;
}

PyMethodDef tk_ids_methods[] = {
    {"token_bytes", py_token_bytes, METH_VARARGS, token_bytes_doc},
    {"equal_ids", py_equal_ids, METH_VARARGS, equal_ids_doc},
    {NULL, NULL, 0, NULL},
};
