/* The added-token scan in C: Matcher.scan finds the added tokens of a UTF-8 text,
 * leftmost-longest (what the ``tokenizers`` added-vocabulary split does, and what the trie
 * regex in boundaries.py matches), marking the boundary tokens. boundaries.py is the
 * reference (tests compare the two) and the fallback when this module is not built.
 *
 * A request of a growing conversation scans the few KB it appended; a rewritten history
 * scans the whole text (~330 tokens in 57 KB), where the regex and the Python loop that
 * reads its matches cost ~100 us.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

/* ---------------------------------------------------------------------------------- */
/* Matcher: a trie of the added tokens.                                                */

typedef struct {
    int32_t first_child; /* index into the edges array, or -1 */
    int32_t n_children;
    int32_t word_len;    /* > 0: a token ends here (its length) */
    int8_t boundary;     /* that token is a boundary */
} Node;

typedef struct {
    unsigned char byte;
    int32_t node;
} Edge;

typedef struct {
    PyObject_HEAD
    Node *nodes;
    Py_ssize_t n_nodes;
    Edge *edges;
    Py_ssize_t n_edges;
    unsigned char first[256]; /* bytes a token starts with */
    int single_first;         /* the one first byte when all tokens share it, else -1 */
} Matcher;

static void Matcher_dealloc(Matcher *self) {
    PyMem_Free(self->nodes);
    PyMem_Free(self->edges);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* Build from a list of (token bytes, is_boundary). Children are stored contiguously per
 * node, sorted by byte: built level by level from the sorted token list. */
typedef struct {
    const unsigned char *s;
    Py_ssize_t len;
    int boundary;
} Word;

static int word_cmp(const void *a, const void *b) {
    const Word *x = a, *y = b;
    Py_ssize_t n = x->len < y->len ? x->len : y->len;
    int c = memcmp(x->s, y->s, (size_t)n);
    if (c) return c;
    return (x->len > y->len) - (x->len < y->len);
}

/* Nodes for words[lo:hi), all sharing their first `depth` bytes; returns the node index. */
static int32_t build(Matcher *m, Word *words, Py_ssize_t lo, Py_ssize_t hi, Py_ssize_t depth, Py_ssize_t cap_nodes,
                     Py_ssize_t cap_edges) {
    int32_t me = (int32_t)m->n_nodes++;
    Node *node = &m->nodes[me];
    node->first_child = -1;
    node->n_children = 0;
    node->word_len = 0;
    node->boundary = 0;
    /* Words that end here come first in sorted order. */
    while (lo < hi && words[lo].len == depth) {
        node->word_len = (int32_t)depth;
        node->boundary = (int8_t)words[lo].boundary;
        lo++;
    }
    /* Count distinct next bytes, reserve their edges contiguously, then recurse. */
    int32_t n_children = 0;
    for (Py_ssize_t i = lo; i < hi; i++)
        if (i == lo || words[i].s[depth] != words[i - 1].s[depth]) n_children++;
    if (n_children == 0) return me;
    int32_t first_edge = (int32_t)m->n_edges;
    m->n_edges += n_children;
    m->nodes[me].first_child = first_edge;
    m->nodes[me].n_children = n_children;
    int32_t k = 0;
    Py_ssize_t i = lo;
    while (i < hi) {
        Py_ssize_t j = i + 1;
        while (j < hi && words[j].s[depth] == words[i].s[depth]) j++;
        unsigned char b = words[i].s[depth];
        int32_t child = build(m, words, i, j, depth + 1, cap_nodes, cap_edges);
        m->edges[first_edge + k].byte = b;
        m->edges[first_edge + k].node = child;
        k++;
        i = j;
    }
    return me;
}

static int Matcher_init(Matcher *self, PyObject *args, PyObject *kwds) {
    PyObject *items;
    static char *kwlist[] = {"tokens", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O!", kwlist, &PyList_Type, &items)) return -1;
    Py_ssize_t n = PyList_GET_SIZE(items);
    Word *words = PyMem_Calloc((size_t)(n ? n : 1), sizeof(Word));
    if (!words) {
        PyErr_NoMemory();
        return -1;
    }
    Py_ssize_t total = 1;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PyList_GET_ITEM(items, i), *tok;
        int boundary;
        if (!PyTuple_Check(item) || !PyArg_ParseTuple(item, "Sp", &tok, &boundary)) {
            PyMem_Free(words);
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "tokens: a list of (bytes, bool)");
            return -1;
        }
        if (PyBytes_GET_SIZE(tok) == 0) {
            PyMem_Free(words);
            PyErr_SetString(PyExc_ValueError, "tokens must not be empty");
            return -1;
        }
        words[i].s = (const unsigned char *)PyBytes_AS_STRING(tok);
        words[i].len = PyBytes_GET_SIZE(tok);
        words[i].boundary = boundary;
        total += words[i].len;
    }
    qsort(words, (size_t)n, sizeof(Word), word_cmp);
    /* A duplicate token: keep one (its boundary flag is the last one's, as a set would). */
    PyMem_Free(self->nodes);
    PyMem_Free(self->edges);
    self->nodes = PyMem_Calloc((size_t)total, sizeof(Node));
    self->edges = PyMem_Calloc((size_t)total, sizeof(Edge));
    self->n_nodes = self->n_edges = 0;
    if (!self->nodes || !self->edges) {
        PyMem_Free(words);
        PyErr_NoMemory();
        return -1;
    }
    memset(self->first, 0, sizeof(self->first));
    for (Py_ssize_t i = 0; i < n; i++) self->first[words[i].s[0]] = 1;
    int distinct = 0, only = -1;
    for (int b = 0; b < 256; b++)
        if (self->first[b]) distinct++, only = b;
    self->single_first = distinct == 1 ? only : -1;
    build(self, words, 0, n, 0, total, total);
    PyMem_Free(words);
    return 0;
}

/* The longest token at data[p:], or 0; *boundary set for it. */
static inline Py_ssize_t match_at(const Matcher *m, const unsigned char *data, Py_ssize_t p, Py_ssize_t n,
                                  int *boundary) {
    int32_t node = 0;
    Py_ssize_t best = 0;
    for (Py_ssize_t q = p; q < n; q++) {
        const Node *nd = &m->nodes[node];
        int32_t next = -1;
        const Edge *e = &m->edges[nd->first_child];
        for (int32_t k = 0; k < nd->n_children; k++) {
            if (e[k].byte == data[q]) {
                next = e[k].node;
                break;
            }
            if (e[k].byte > data[q]) break;
        }
        if (next < 0) break;
        node = next;
        if (m->nodes[node].word_len) {
            best = m->nodes[node].word_len;
            *boundary = m->nodes[node].boundary;
        }
    }
    return best;
}

PyDoc_STRVAR(scan_doc,
"scan(data, pos, tail_from) -> (spans, tail, kept_end, stable)\n\n"
"The added tokens of ``data`` from ``pos``, leftmost-longest: ``spans`` the (start, end) of\n"
"each boundary token, ``tail`` those of every token starting at or after ``tail_from``,\n"
"``kept_end`` the end of the last token starting before it (or -1: none), ``stable`` how\n"
"many of ``spans`` start before it.");

static PyObject *Matcher_scan(Matcher *self, PyObject *args) {
    Py_buffer view;
    Py_ssize_t pos, tail_from;
    if (!PyArg_ParseTuple(args, "y*nn", &view, &pos, &tail_from)) return NULL;
    const unsigned char *data = view.buf;
    Py_ssize_t n = view.len;
    PyObject *spans = PyList_New(0), *tail = PyList_New(0);
    Py_ssize_t kept_end = -1, stable = -1;
    if (!spans || !tail) goto fail;
    if (pos < 0) pos = 0;
    Py_ssize_t p = pos;
    while (p < n) {
        if (self->single_first >= 0) {
            const unsigned char *hit = memchr(data + p, self->single_first, (size_t)(n - p));
            if (!hit) break;
            p = hit - data;
        } else if (!self->first[data[p]]) {
            p++;
            continue;
        }
        int boundary = 0;
        Py_ssize_t len = match_at(self, data, p, n, &boundary);
        if (!len) {
            p++;
            continue;
        }
        PyObject *span = Py_BuildValue("(nn)", p, p + len);
        if (!span) goto fail;
        if (p < tail_from) {
            kept_end = p + len;
        } else {
            if (stable < 0) stable = PyList_GET_SIZE(spans);
            if (PyList_Append(tail, span) < 0) {
                Py_DECREF(span);
                goto fail;
            }
        }
        if (boundary && PyList_Append(spans, span) < 0) {
            Py_DECREF(span);
            goto fail;
        }
        Py_DECREF(span);
        p += len;
    }
    PyBuffer_Release(&view);
    if (stable < 0) stable = PyList_GET_SIZE(spans);
    return Py_BuildValue("(NNnn)", spans, tail, kept_end, stable);
fail:
    PyBuffer_Release(&view);
    Py_XDECREF(spans);
    Py_XDECREF(tail);
    return NULL;
}

static PyMethodDef Matcher_methods[] = {
    {"scan", (PyCFunction)Matcher_scan, METH_VARARGS, scan_doc},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject MatcherType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "tokcache.engine._speedups.Matcher",
    .tp_basicsize = sizeof(Matcher),
    .tp_dealloc = (destructor)Matcher_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Matcher(tokens): leftmost-longest matching of added tokens [(bytes, is_boundary)].",
    .tp_methods = Matcher_methods,
    .tp_init = (initproc)Matcher_init,
    .tp_new = PyType_GenericNew,
};

static PyMethodDef methods[] = {
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "tokcache.engine._speedups",
    "The added-token scan in C (boundaries.py is the reference).", -1, methods,
};

PyMODINIT_FUNC PyInit__speedups(void) {
    if (PyType_Ready(&MatcherType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    Py_INCREF(&MatcherType);
    if (PyModule_AddObject(m, "Matcher", (PyObject *)&MatcherType) < 0) {
        Py_DECREF(&MatcherType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
