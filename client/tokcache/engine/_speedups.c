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

#include "_pyint.h"
#include "_ids.h"

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


/* ---------------------------------------------------------------------------------- */
/* Spans: a text's boundary spans as one flat array of (start, end) pairs.             */
/*                                                                                    */
/* A read keeps its text's spans for the next turn, which copies its base's stable    */
/* ones and appends what it scanned. As a list of (int, int) tuples that copy was a    */
/* reference-count write to each of ~1000 tuples spread over the heap, and freeing the */
/* base's list another (1.5 us warm, 12.8 us with the tuples out of the caches, as a  */
/* process sharing its cores with many others finds them after every switch); as one   */
/* array it is a memcpy (1.8 us cold). To Python it is a read-only sequence of         */
/* (start, end) tuples, made on access (untracked: two ints), equal to a list of the   */
/* same tuples; a slice is such a list. Not a container of objects: no GC.             */

typedef struct {
    PyObject_HEAD
    Py_ssize_t n, cap;
    Py_ssize_t *v; /* v[2i], v[2i + 1]: span i's start and end */
} Spans;

static PyTypeObject SpansType;
#define Spans_Check(o) (Py_TYPE(o) == &SpansType)

static Spans *spans_alloc(Py_ssize_t cap) {
    Spans *self = PyObject_New(Spans, &SpansType);
    if (!self) return NULL;
    self->n = 0;
    self->cap = cap < 8 ? 8 : cap;
    self->v = PyMem_Malloc(sizeof(Py_ssize_t) * 2 * (size_t)self->cap);
    if (!self->v) {
        self->cap = 0;
        Py_DECREF(self);
        PyErr_NoMemory();
        return NULL;
    }
    return self;
}

static int spans_push(Spans *self, Py_ssize_t start, Py_ssize_t end) {
    if (self->n == self->cap) {
        Py_ssize_t cap = self->cap * 2;
        Py_ssize_t *v = PyMem_Realloc(self->v, sizeof(Py_ssize_t) * 2 * (size_t)cap);
        if (!v) {
            PyErr_NoMemory();
            return -1;
        }
        self->v = v;
        self->cap = cap;
    }
    self->v[2 * self->n] = start;
    self->v[2 * self->n + 1] = end;
    self->n++;
    return 0;
}

static void Spans_dealloc(Spans *self) {
    PyMem_Free(self->v);
    PyObject_Free(self);
}

static Py_ssize_t Spans_len(Spans *self) { return self->n; }

/* Span i as a new (start, end) tuple, untracked (two ints: in no cycle). */
static PyObject *spans_tuple(const Spans *self, Py_ssize_t i) {
    PyObject *t = Py_BuildValue("(nn)", self->v[2 * i], self->v[2 * i + 1]);
    if (t) PyObject_GC_UnTrack(t);
    return t;
}

static PyObject *Spans_item(Spans *self, Py_ssize_t i) {
    if (i < 0 || i >= self->n) {
        PyErr_SetString(PyExc_IndexError, "Spans index out of range");
        return NULL;
    }
    return spans_tuple(self, i);
}

/* spans[a:b:step] as a list of (start, end) tuples. */
static PyObject *spans_list(const Spans *self, Py_ssize_t start, Py_ssize_t step, Py_ssize_t count) {
    PyObject *out = PyList_New(count);
    if (!out) return NULL;
    for (Py_ssize_t k = 0, i = start; k < count; k++, i += step) {
        PyObject *t = spans_tuple(self, i);
        if (!t) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, k, t);
    }
    return out;
}

static PyObject *Spans_subscript(Spans *self, PyObject *key) {
    if (PyIndex_Check(key)) {
        Py_ssize_t i = PyNumber_AsSsize_t(key, PyExc_IndexError);
        if (i == -1 && PyErr_Occurred()) return NULL;
        if (i < 0) i += self->n;
        return Spans_item(self, i);
    }
    if (PySlice_Check(key)) {
        Py_ssize_t start, stop, step;
        if (PySlice_Unpack(key, &start, &stop, &step) < 0) return NULL;
        Py_ssize_t count = PySlice_AdjustIndices(self->n, &start, &stop, step);
        return spans_list(self, start, step, count);
    }
    PyErr_Format(PyExc_TypeError, "Spans indices must be integers or slices, not %.200s", Py_TYPE(key)->tp_name);
    return NULL;
}

static PyObject *Spans_richcompare(PyObject *a, PyObject *b, int op) {
    if ((op != Py_EQ && op != Py_NE) || !Spans_Check(a)) Py_RETURN_NOTIMPLEMENTED;
    const Spans *x = (const Spans *)a;
    if (Spans_Check(b)) {
        const Spans *y = (const Spans *)b;
        int eq = x->n == y->n && (x->n == 0 || memcmp(x->v, y->v, sizeof(Py_ssize_t) * 2 * (size_t)x->n) == 0);
        return PyBool_FromLong(op == Py_EQ ? eq : !eq);
    }
    if (!PyList_Check(b) && !PyTuple_Check(b)) Py_RETURN_NOTIMPLEMENTED;
    PyObject *mine = spans_list(x, 0, 1, x->n);
    if (!mine) return NULL;
    PyObject *other = PyTuple_Check(b) ? PySequence_List(b) : (Py_INCREF(b), b);
    if (!other) {
        Py_DECREF(mine);
        return NULL;
    }
    PyObject *res = PyObject_RichCompare(mine, other, op);
    Py_DECREF(mine);
    Py_DECREF(other);
    return res;
}

static PyObject *Spans_repr(Spans *self) {
    PyObject *mine = spans_list(self, 0, 1, self->n);
    if (!mine) return NULL;
    PyObject *res = PyUnicode_FromFormat("Spans(%R)", mine);
    Py_DECREF(mine);
    return res;
}

/* Spans(iterable of (start, end)): for tests and tools; the engine makes them in extend. */
static PyObject *Spans_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    PyObject *src = NULL;
    if (kwds && PyDict_GET_SIZE(kwds)) {
        PyErr_SetString(PyExc_TypeError, "Spans() takes no keyword arguments");
        return NULL;
    }
    if (!PyArg_ParseTuple(args, "|O:Spans", &src)) return NULL;
    PyObject *seq = src ? PySequence_Fast(src, "Spans(): expected an iterable of (start, end)") : PyList_New(0);
    if (!seq) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    Spans *self = spans_alloc(n);
    if (!self) {
        Py_DECREF(seq);
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *t = PySequence_Fast_GET_ITEM(seq, i);
        Py_ssize_t a, b;
        if (!PyTuple_Check(t) || PyTuple_GET_SIZE(t) != 2) {
            PyErr_SetString(PyExc_TypeError, "Spans(): expected (start, end) tuples");
            goto fail;
        }
        a = PyLong_AsSsize_t(PyTuple_GET_ITEM(t, 0));
        if (a == -1 && PyErr_Occurred()) goto fail;
        b = PyLong_AsSsize_t(PyTuple_GET_ITEM(t, 1));
        if (b == -1 && PyErr_Occurred()) goto fail;
        if (spans_push(self, a, b) < 0) goto fail;
    }
    Py_DECREF(seq);
    return (PyObject *)self;
fail:
    Py_DECREF(seq);
    Py_DECREF(self);
    return NULL;
}

static PyObject *Spans_sizeof(Spans *self, PyObject *Py_UNUSED(ignored)) {
    return PyLong_FromSsize_t((Py_ssize_t)sizeof(Spans) + (Py_ssize_t)sizeof(Py_ssize_t) * 2 * self->cap);
}

static PySequenceMethods Spans_as_sequence = {
    .sq_length = (lenfunc)Spans_len,
    .sq_item = (ssizeargfunc)Spans_item,
};

static PyMappingMethods Spans_as_mapping = {
    .mp_length = (lenfunc)Spans_len,
    .mp_subscript = (binaryfunc)Spans_subscript,
};

static PyMethodDef Spans_methods[] = {
    {"__sizeof__", (PyCFunction)Spans_sizeof, METH_NOARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject SpansType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "tokcache.engine._speedups.Spans",
    .tp_basicsize = sizeof(Spans),
    .tp_dealloc = (destructor)Spans_dealloc,
    .tp_repr = (reprfunc)Spans_repr,
    .tp_as_sequence = &Spans_as_sequence,
    .tp_as_mapping = &Spans_as_mapping,
    .tp_hash = PyObject_HashNotImplemented,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Spans(iterable of (start, end)): boundary spans as one flat array; a read-only sequence of tuples.",
    .tp_richcompare = Spans_richcompare,
    .tp_methods = Spans_methods,
    .tp_new = Spans_new,
};

PyDoc_STRVAR(scan_doc,
"scan(data, pos, tail_from) -> (spans, tail, kept_end, stable)\n\n"
"The added tokens of ``data`` from ``pos``, leftmost-longest: ``spans`` the (start, end) of\n"
"each boundary token, ``tail`` those of every token starting at or after ``tail_from``,\n"
"``kept_end`` the end of the last token starting before it (or -1: none), ``stable`` how\n"
"many of ``spans`` start before it.");

/* Append the added tokens of data[pos:n] to ``spans`` (boundary tokens) and ``tail`` (every
 * token starting at or after tail_from); *kept_end: end of the last token starting before
 * tail_from (unchanged if none); *stable: len(spans) when the first tail token was seen, else
 * len(spans) at the end. 0 on success, -1 with an exception set. */
static int scan_into(const Matcher *self, const unsigned char *data, Py_ssize_t n, Py_ssize_t pos,
                     Py_ssize_t tail_from, Spans *spans, PyObject *tail, Py_ssize_t *kept_end, Py_ssize_t *stable) {
    Py_ssize_t p = pos < 0 ? 0 : pos;
    *stable = -1;
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
        if (p < tail_from) {
            *kept_end = p + len;
        } else {
            PyObject *span = Py_BuildValue("(nn)", p, p + len);
            if (!span) return -1;
            /* Two ints: in no cycle (CPython untracks such a tuple itself, but only when a
               collection first meets it; a scan's tail is kept for the next turn). */
            PyObject_GC_UnTrack(span);
            if (*stable < 0) *stable = spans->n;
            int failed = PyList_Append(tail, span) < 0;
            Py_DECREF(span);
            if (failed) return -1;
        }
        if (boundary && spans_push(spans, p, p + len) < 0) return -1;
        p += len;
    }
    if (*stable < 0) *stable = spans->n;
    return 0;
}

static PyObject *Matcher_scan(Matcher *self, PyObject *args) {
    Py_buffer view;
    Py_ssize_t pos, tail_from;
    if (!PyArg_ParseTuple(args, "y*nn", &view, &pos, &tail_from)) return NULL;
    Spans *found = spans_alloc(64);
    PyObject *tail = PyList_New(0), *spans = NULL;
    Py_ssize_t kept_end = -1, stable = -1;
    if (!found || !tail || scan_into(self, view.buf, view.len, pos, tail_from, found, tail, &kept_end, &stable) < 0 ||
        !(spans = spans_list(found, 0, 1, found->n))) {
        PyBuffer_Release(&view);
        Py_XDECREF(found);
        Py_XDECREF(tail);
        return NULL;
    }
    PyBuffer_Release(&view);
    Py_DECREF(found);
    /* Lists of (int, int) tuples: in no cycle; kept by the memo (see py_untrack). The
       Python path's scan keeps lists (it extends them); the native extend makes Spans. */
    PyObject_GC_UnTrack(spans);
    PyObject_GC_UnTrack(tail);
    return Py_BuildValue("(NNnn)", spans, tail, kept_end, stable);
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


/* ---------------------------------------------------------------------------------- */
/* extend: the steady-state lookup of a text that extends one this process scanned.   */
/*                                                                                    */
/* lookup.py's Lookup._tokenize is the reference; this does its first half (scan, keys, */
/* hit) in one call for the common case and says None for anything else, which the   */
/* Python path then serves from the start. Same inputs, same outputs: the tests run   */
/* both on the same histories and compare.                                            */

static PyObject *s_text, *s_data, *s_spans, *s_stable, *s_tail_from, *s_kept_end, *s_hashers, *s_move_to_end;

#include "_hasher.h"
#include "_index.h"

/* The store extension's Hasher (its capsule, imported at init, which fails without it): key
 * states are its objects, hashed on here in their state, no call into Python. */
static const TkHasherAPI *hasher_api;

static int as_ssize(PyObject *o, Py_ssize_t *out) {
    *out = PyLong_AsSsize_t(o);
    return (*out == -1 && PyErr_Occurred()) ? -1 : 0;
}

/* len(spans): a Spans or a list of (start, end). */
static inline Py_ssize_t spans_len(PyObject *spans) {
    return Spans_Check(spans) ? ((Spans *)spans)->n : PyList_GET_SIZE(spans);
}

/* The (start, end) of spans[i] (0 <= i < spans_len: the caller's bound). */
static int span_at(PyObject *spans, Py_ssize_t i, Py_ssize_t *start, Py_ssize_t *end) {
    if (Spans_Check(spans)) {
        *start = ((Spans *)spans)->v[2 * i];
        *end = ((Spans *)spans)->v[2 * i + 1];
        return 0;
    }
    PyObject *t = PyList_GET_ITEM(spans, i);
    if (!PyTuple_Check(t) || PyTuple_GET_SIZE(t) != 2) {
        PyErr_SetString(PyExc_TypeError, "spans: a list of (start, end)");
        return -1;
    }
    if (as_ssize(PyTuple_GET_ITEM(t, 0), start) < 0) return -1;
    return as_ssize(PyTuple_GET_ITEM(t, 1), end);
}

/* Feed data[a:b] (bytes) to a hasher state. */
static inline void feed(TkHashState *h, PyObject *data, Py_ssize_t a, Py_ssize_t b) {
    if (b > a) hasher_api->update(h, PyBytes_AS_STRING(data) + a, (size_t)(b - a));
}

/* A key: the first 16 bytes of the digest of ``h``, after ``suffix`` (n bytes) if any;
 * ``h`` itself is unchanged. */
static PyObject *key_of(const TkHashState *h, const char *suffix, size_t n) {
    PyObject *k = PyBytes_FromStringAndSize(NULL, TK_KEY_SIZE);
    if (!k) return NULL;
    if (n) {
        TkHashState t = *h;
        hasher_api->update(&t, suffix, n);
        hasher_api->finalize(&t, (uint8_t *)PyBytes_AS_STRING(k), TK_KEY_SIZE);
    } else {
        hasher_api->finalize(h, (uint8_t *)PyBytes_AS_STRING(k), TK_KEY_SIZE);
    }
    return k;
}

/* The set bits of x (SWAR: __builtin_popcountll is a libgcc call unless built for a CPU with popcnt). */
static inline Py_ssize_t popcount64(uint64_t x) {
    x = x - ((x >> 1) & 0x5555555555555555ULL);
    x = (x & 0x3333333333333333ULL) + ((x >> 2) & 0x3333333333333333ULL);
    x = (x + (x >> 4)) & 0x0F0F0F0F0F0F0F0FULL;
    return (Py_ssize_t)((x * 0x0101010101010101ULL) >> 56);
}

/* The characters of n bytes of valid UTF-8: the bytes that are not continuation bytes
 * (10xxxxxx), counted eight at a time (a tail of 16 KB byte by byte took ~5 us). */
static Py_ssize_t utf8_chars(const unsigned char *d, Py_ssize_t n) {
    Py_ssize_t cont = 0, i = 0;
    for (; i + 8 <= n; i += 8) {
        uint64_t x;
        memcpy(&x, d + i, 8);
        cont += popcount64(x & ~(x << 1) & 0x8080808080808080ULL);
    }
    for (; i < n; i++) cont += (d[i] & 0xC0) == 0x80;
    return n - cont;
}

/* The attribute ``name`` of ``o`` as a Py_ssize_t. */
static int attr_ssize(PyObject *o, PyObject *name, Py_ssize_t *out) {
    PyObject *v = PyObject_GetAttr(o, name);
    if (!v) return -1;
    int r = as_ssize(v, out);
    Py_DECREF(v);
    return r;
}

PyDoc_STRVAR(extend_doc,
"extend(text, bases, ns, ctx, tail, now, ar, root) -> tuple | int\n\n"
"Lookup._tokenize's scan, keys and hit for ``text``, from the first of ``bases`` (the Scans\n"
"BoundaryScanner.bases lists) it extends that holds a KeyState for ``ns`` (only the appended part is\n"
"scanned and hashed), else from the start (``root``: a Hasher fed ``ns``'s header), when it has no\n"
"L0 entry and no gallop applies. ``ctx`` is (matcher, maxlen, grid, tail_probes, index_buffer,\n"
"index_off, n_buckets, memo_by_lsn, memo_entries, max_text_bytes). Returns (base or None, data,\n"
"spans, tail, tail_from, kept_end, stable, keyed, keys, state_hasher, state_cut, exact_key, pos,\n"
"key, container, tokens, tail_chars, ar_keys, ar_at), or why it declined (an int >= 1, named by\n"
"lookup.py's _DECLINED): serve it in Python. ``container`` and ``tokens`` are the winning keyed\n"
"cut's chain when this process holds it (ChainMemo.held_key's answer, read from\n"
"ChainMemo.native_view's two dicts), else None and -1: the caller reads it. With ``ar`` (recorded\n"
"outputs may apply) the AR keys of the boundaries past the hit are made (``ar_keys``: by cut\n"
"index, None elsewhere) and ``ar_at`` is the highest of them that is live (-1: none), for the\n"
"caller to read; without, ``ar_keys`` is None and ``ar_at`` -1.");

/* Why extend declined a text (its return value then; the Python path serves it): the order
 * of lookup.py's _DECLINED, which names them. */
enum {
    TK_NO_BASE = 1,     /* (no longer returned: a text that extends no base is hashed from the start) */
    TK_BASE_STATE,      /* its base holds no usable key state for this namespace */
    TK_INVALID_TEXT,    /* a lone surrogate: the Python path reports it */
    TK_TOO_LARGE,       /* over max_text_bytes: the Python path reports it */
    TK_UNSTABLE,        /* the appended part moved a boundary at or before the base's state cut */
    TK_WINDOW_KEYS,     /* a key of the probe window the base never made */
    TK_L0,              /* the whole text is cached (L0): the Python path reads it */
    TK_NO_WINDOW_HIT,   /* no keyed cut of the window is cached (a miss, or a gallop further back) */
    TK_CHAIN_NOT_HELD,  /* (no longer returned: the caller reads a chain the memo does not hold) */
    TK_AR_KEYS,         /* the base never made the AR keys the recorded-output search needs */
};
#define DECLINE(reason) \
    do {                \
        declined = (reason); \
        goto none;      \
    } while (0)

static PyObject *py_extend(PyObject *self, PyObject *args) {
    PyObject *text, *bases, *ns, *ctx;
    unsigned long long tail;
    double now;
    int want_ar;
    PyObject *root;
    if (!PyArg_ParseTuple(args, "UO!OO!KdpO", &text, &PyList_Type, &bases, &ns, &PyTuple_Type, &ctx, &tail, &now,
                          &want_ar, &root))
        return NULL;
    Matcher *matcher;
    Py_ssize_t maxlen, grid, tail_probes, index_off, max_text_bytes;
    unsigned long long n_buckets;
    PyObject *index_obj, *memo_by_lsn, *memo_entries;
    if (!PyArg_ParseTuple(ctx, "O!nnnOnKO!O!n", &MatcherType, &matcher, &maxlen, &grid, &tail_probes, &index_obj,
                          &index_off, &n_buckets, &PyDict_Type, &memo_by_lsn, &PyDict_Type, &memo_entries,
                          &max_text_bytes))
        return NULL;

    int declined = 0; /* DECLINE's reason */
    PyObject *result = NULL, *snapshot = NULL, *base = NULL, *old = NULL, *hashers = NULL, *sub = NULL,
             *added = NULL, *base_data = NULL, *data = NULL, *base_spans = NULL, *spans = NULL, *tail_list = NULL,
             *keyed = NULL, *keys = NULL, *state = NULL, *exact = NULL, *ident = NULL, *entry = NULL,
             *st = NULL, *ar_keys = NULL, *empty = NULL;
    /* Hasher states on the stack (plain data, 112 bytes each): the key pass, the AR keys'. */
    TkHashState hs, as;
    Py_buffer view;
    int have_view = 0;

    /* 1. The text this one extends: the first of ``bases`` it extends. */
    snapshot = PySequence_Tuple(bases);
    if (!snapshot) goto fail;
    Py_ssize_t n_chars = PyUnicode_GET_LENGTH(text), m = 0;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(snapshot) && !base; i++) {
        PyObject *c = PyTuple_GET_ITEM(snapshot, i);
        old = PyObject_GetAttr(c, s_text);
        if (!old) goto fail;
        if (PyUnicode_Check(old)) {
            m = PyUnicode_GET_LENGTH(old);
            if (m <= n_chars && (m == 0 || PyUnicode_READ_CHAR(old, m - 1) == PyUnicode_READ_CHAR(text, m - 1))) {
                Py_ssize_t r = PyUnicode_Tailmatch(text, old, 0, m, -1);
                if (r < 0) goto fail;
                if (r) base = Py_NewRef(c);
            }
        }
        Py_CLEAR(old);
    }
    /* 2. Its key state for this namespace: (cut, hasher, l1, ar, keyed); without a base, the
     * namespace's root state before the first cut (-1), no keys. */
    Py_ssize_t r_cut = -1;
    PyObject *r_hasher = root, *r_l1, *r_ar, *r_keyed;
    if (base) {
        hashers = PyObject_GetAttr(base, s_hashers);
        if (!hashers) goto fail;
        if (!PyDict_Check(hashers)) DECLINE(TK_BASE_STATE);
        st = PyDict_GetItemWithError(hashers, ns);
        if (!st) {
            if (PyErr_Occurred()) goto fail;
            DECLINE(TK_BASE_STATE);
        }
        Py_INCREF(st); /* held: another thread may file a new state meanwhile */
        if (!PyTuple_Check(st) || PyTuple_GET_SIZE(st) != 5 || !PyList_Check(PyTuple_GET_ITEM(st, 2)) ||
            !PyList_Check(PyTuple_GET_ITEM(st, 4)))
            DECLINE(TK_BASE_STATE);
        if (as_ssize(PyTuple_GET_ITEM(st, 0), &r_cut) < 0) goto fail;
        r_hasher = PyTuple_GET_ITEM(st, 1);
        r_l1 = PyTuple_GET_ITEM(st, 2);
        r_ar = PyTuple_GET_ITEM(st, 3);
        r_keyed = PyTuple_GET_ITEM(st, 4);
    } else {
        m = 0;
        empty = PyList_New(0);
        if (!empty) goto fail;
        r_l1 = r_ar = r_keyed = empty;
    }
    /* (None: a state cut back, rebuilt by the Python path; another hasher type, such as
     * hashlib's: the Python path's) */
    if (!hasher_api || Py_TYPE(r_hasher) != hasher_api->type) DECLINE(TK_BASE_STATE);

    /* 3. The text as UTF-8: the base's bytes, then the appended part's. A lone surrogate is
     * the Python path's to report (with its index in the whole text). */
    sub = PyUnicode_Substring(text, m, n_chars);
    if (!sub) goto fail;
    added = PyUnicode_AsUTF8String(sub);
    if (!added) {
        if (!PyErr_ExceptionMatches(PyExc_UnicodeEncodeError)) goto fail;
        PyErr_Clear();
        DECLINE(TK_INVALID_TEXT);
    }
    base_data = base ? PyObject_GetAttr(base, s_data) : PyBytes_FromStringAndSize(NULL, 0);
    if (!base_data) goto fail;
    if (!PyBytes_Check(base_data)) DECLINE(TK_BASE_STATE);
    Py_ssize_t b_len = PyBytes_GET_SIZE(base_data), a_len = PyBytes_GET_SIZE(added), total = b_len + a_len;
    if (total > max_text_bytes) DECLINE(TK_TOO_LARGE); /* RequestTooLarge: the Python path's */
    data = PyBytes_FromStringAndSize(NULL, total);
    if (!data) goto fail;
    memcpy(PyBytes_AS_STRING(data), PyBytes_AS_STRING(base_data), (size_t)b_len);
    memcpy(PyBytes_AS_STRING(data) + b_len, PyBytes_AS_STRING(added), (size_t)a_len);

    /* 4. Boundaries: the base's stable spans, then the matches from its tail region on. */
    Py_ssize_t b_stable = 0, b_tail_from = 0, b_kept_end = 0;
    if (base) {
        base_spans = PyObject_GetAttr(base, s_spans);
        if (!base_spans || attr_ssize(base, s_stable, &b_stable) < 0 ||
            attr_ssize(base, s_tail_from, &b_tail_from) < 0 || attr_ssize(base, s_kept_end, &b_kept_end) < 0)
            goto fail;
        if (!(Spans_Check(base_spans) || PyList_Check(base_spans)) || b_stable < 0 ||
            b_stable > spans_len(base_spans))
            DECLINE(TK_BASE_STATE);
    } else {
        base_spans = PyList_New(0);
        if (!base_spans) goto fail;
    }
    /* The base's stable spans, copied flat (see Spans), then the new ones appended. */
    Spans *own = spans_alloc(b_stable + 64);
    spans = (PyObject *)own;
    tail_list = PyList_New(0);
    if (!spans || !tail_list) goto fail;
    if (Spans_Check(base_spans)) {
        if (b_stable) memcpy(own->v, ((Spans *)base_spans)->v, sizeof(Py_ssize_t) * 2 * (size_t)b_stable);
        own->n = b_stable;
    } else {
        for (Py_ssize_t i = 0; i < b_stable; i++) {
            Py_ssize_t si, ei;
            if (span_at(base_spans, i, &si, &ei) < 0 || spans_push(own, si, ei) < 0) goto fail;
        }
    }
    Py_ssize_t tail_from = total - maxlen + 1 > 0 ? total - maxlen + 1 : 0, kept_end = b_kept_end, stable;
    if (scan_into(matcher, (const unsigned char *)PyBytes_AS_STRING(data), total,
                  b_tail_from > b_kept_end ? b_tail_from : b_kept_end, tail_from, own, tail_list, &kept_end,
                  &stable) < 0)
        goto fail;
    Py_ssize_t n = own->n;
    if ((base && (r_cut < 0 || r_cut >= n)) || stable < 1 || stable - 1 < r_cut) DECLINE(TK_UNSTABLE);

    /* 5. Keyed cuts (KEY_GRID): the base's up to its state's cut, then the new ones. */
    Py_ssize_t p = 0, nk_old = PyList_GET_SIZE(r_keyed);
    while (p < nk_old) {
        Py_ssize_t v;
        if (as_ssize(PyList_GET_ITEM(r_keyed, p), &v) < 0) goto fail;
        if (v > r_cut) break;
        p++;
    }
    if (p > PyList_GET_SIZE(r_l1)) DECLINE(TK_BASE_STATE);
    keyed = PyList_GetSlice(r_keyed, 0, p);
    keys = PyList_GetSlice(r_l1, 0, p);
    if (!keyed || !keys) goto fail;
    {
        Py_ssize_t s0, e0, prev_block = -1;
        if (r_cut >= 0) {
            if (span_at(spans, r_cut, &s0, &e0) < 0) goto fail;
            if (grid) prev_block = e0 / grid;
        }
        for (Py_ssize_t i = r_cut + 1; i < n; i++) {
            Py_ssize_t si, ei;
            if (span_at(spans, i, &si, &ei) < 0) goto fail;
            if (grid && ei / grid == prev_block) continue;
            if (grid) prev_block = ei / grid;
            PyObject *iv = PyLong_FromSsize_t(i);
            if (!iv || PyList_Append(keyed, iv) < 0 || PyList_Append(keys, Py_None) < 0) {
                Py_XDECREF(iv);
                goto fail;
            }
            Py_DECREF(iv);
        }
    }
    Py_ssize_t nk = PyList_GET_SIZE(keyed), lo = nk - tail_probes > 0 ? nk - tail_probes : 0;
    for (Py_ssize_t q = lo; q < p; q++)
        if (PyList_GET_ITEM(keys, q) == Py_None) DECLINE(TK_WINDOW_KEYS); /* a window key the base lacks */

    /* 6. One hashing pass from the base's state: the new keyed cuts, the state at the last
     * stable cut, the whole text (L0). */
    Py_ssize_t last = stable - 1, r_off = 0, keep_at, tmp;
    if ((r_cut >= 0 && span_at(spans, r_cut, &tmp, &r_off) < 0) || span_at(spans, last, &tmp, &keep_at) < 0)
        goto fail;
    hs = ((TkHasher *)r_hasher)->state;
    Py_ssize_t start = r_off, q = p;
    int keep_done = last == r_cut;
    if (keep_done) state = Py_NewRef(r_hasher);
    while (q < nk || !keep_done) {
        Py_ssize_t end_q = -1;
        if (q < nk) {
            Py_ssize_t ci, si;
            if (as_ssize(PyList_GET_ITEM(keyed, q), &ci) < 0 || span_at(spans, ci, &si, &end_q) < 0) goto fail;
        }
        if (!keep_done && (q >= nk || keep_at <= end_q)) {
            feed(&hs, data, start, keep_at);
            if (keep_at > start) start = keep_at;
            state = (PyObject *)hasher_api->wrap(&hs);
            if (!state) goto fail;
            keep_done = 1;
            continue;
        }
        feed(&hs, data, start, end_q);
        if (end_q > start) start = end_q;
        PyObject *k = key_of(&hs, NULL, 0);
        if (!k) goto fail;
        PyList_SetItem(keys, q, k); /* steals k; replaces None */
        q++;
    }
    feed(&hs, data, start, total);
    exact = key_of(&hs, "\xffL0", 3); /* (tokcache.store.keys: _L0_SUFFIX) */
    if (!exact) goto fail;

    /* 7. Probes: the whole text (an L0 entry is the Python path's to read), then the window
     * of keyed cuts from the last one down (none: the Python path gallops). */
    if (PyObject_GetBuffer(index_obj, &view, PyBUF_SIMPLE) < 0) goto fail;
    have_view = 1;
    if (index_off < 0 || n_buckets == 0 || n_buckets > (uint64_t)PY_SSIZE_T_MAX / TK_BUCKET_SIZE ||
        (uint64_t)view.len < (uint64_t)index_off + n_buckets * TK_BUCKET_SIZE) {
        PyErr_SetString(PyExc_ValueError, "the index does not fit the buffer");
        goto fail;
    }
    const unsigned char *index = (const unsigned char *)view.buf + index_off;
    if (!PyBytes_Check(exact) || PyBytes_GET_SIZE(exact) != TK_KEY_SIZE) DECLINE(TK_BASE_STATE);
    int64_t so = tk_find_slot(index, n_buckets, (const unsigned char *)PyBytes_AS_STRING(exact));
    if (so >= 0 && tk_slot_live(index + so, now, tail)) DECLINE(TK_L0);
    Py_ssize_t pos = -1;
    int64_t hit_slot = -1;
    for (Py_ssize_t r = nk - 1; r >= lo; r--) {
        PyObject *k = PyList_GET_ITEM(keys, r);
        if (!PyBytes_Check(k) || PyBytes_GET_SIZE(k) != TK_KEY_SIZE) DECLINE(TK_BASE_STATE);
        int64_t sl = tk_find_slot(index, n_buckets, (const unsigned char *)PyBytes_AS_STRING(k));
        if (sl >= 0 && tk_slot_live(index + sl, now, tail)) {
            pos = r;
            hit_slot = sl;
            break;
        }
    }
    if (pos < 0) DECLINE(TK_NO_WINDOW_HIT);
    uint64_t lsn = tk_load_u64(index + hit_slot + TK_KEY_SIZE) & TK_LSN_MASK;
    PyBuffer_Release(&view);
    have_view = 0;

    /* 8. The winner's chain, from what this process holds (else the caller reads it):
     * ChainMemo.held_key's answer, read from its dicts in place (ChainMemo.native_view). No
     * Python code runs between these reads, and a state the memo's writer leaves between two
     * of its steps can only lack the ident or the entry: not held, read by the caller. */
    PyObject *key = PyList_GET_ITEM(keys, pos); /* borrowed */
    Py_ssize_t tokens = -1;
    PyObject *container = Py_None; /* borrowed: None, or entry's */
    do {
        PyObject *lsn_obj = PyLong_FromUnsignedLongLong(lsn);
        if (!lsn_obj) goto fail;
        ident = PyDict_GetItemWithError(memo_by_lsn, lsn_obj);
        Py_DECREF(lsn_obj);
        if (!ident) {
            if (PyErr_Occurred()) goto fail;
            break;
        }
        Py_INCREF(ident);
        entry = PyDict_GetItemWithError(memo_entries, ident);
        if (!entry) {
            if (PyErr_Occurred()) goto fail;
            break;
        }
        Py_INCREF(entry); /* (container, base, n, floor, {key: ids used}) */
        if (!PyTuple_Check(entry) || PyTuple_GET_SIZE(entry) != 5 || !PyDict_Check(PyTuple_GET_ITEM(entry, 4)))
            break;
        PyObject *used_obj = PyDict_GetItemWithError(PyTuple_GET_ITEM(entry, 4), key);
        if (!used_obj) {
            if (PyErr_Occurred()) goto fail;
            break;
        }
        Py_ssize_t e_base, e_n, used;
        long long floor;
        if (as_ssize(PyTuple_GET_ITEM(entry, 1), &e_base) < 0 || as_ssize(PyTuple_GET_ITEM(entry, 2), &e_n) < 0 ||
            as_ssize(used_obj, &used) < 0)
            goto fail;
        floor = PyLong_AsLongLong(PyTuple_GET_ITEM(entry, 3));
        if (floor == -1 && PyErr_Occurred()) goto fail;
        if (used > e_n || floor < 0 || (unsigned long long)floor < tail) /* floor < 0: not known live */
            break;
        /* The LRU's use mark, as held_key sets it (OrderedDict.move_to_end: C, no Python code). */
        PyObject *moved = PyObject_CallMethodOneArg(memo_entries, s_move_to_end, ident);
        if (!moved) goto fail;
        Py_DECREF(moved);
        tokens = e_base + used;
        container = PyTuple_GET_ITEM(entry, 0);
    } while (0);
    /* 9. The uncached tail's length in characters (UTF-8 lead bytes), so the caller need not
     * decode it to count them: the tail encoder reuses this process's previous encoding.
     * Counted on the shorter side of the hit (none for ASCII): a conversation's hit stays at
     * its first stored turn while its next writes are held (sidecar_client._local: HOLD_S),
     * and counting the whole tail was ~80% of this call's own time (perf, one client process
     * replaying 57 KB chats). */
    Py_ssize_t hit_start, tail_chars = 0;
    {
        Py_ssize_t ci, si;
        if (as_ssize(PyList_GET_ITEM(keyed, pos), &ci) < 0 || span_at(spans, ci, &si, &hit_start) < 0) goto fail;
        const unsigned char *d = (const unsigned char *)PyBytes_AS_STRING(data);
        if (PyUnicode_IS_ASCII(text))
            tail_chars = total - hit_start;
        else if (hit_start < total - hit_start)
            tail_chars = n_chars - utf8_chars(d, hit_start);
        else
            tail_chars = utf8_chars(d + hit_start, total - hit_start);
    }
    /* 10. Recorded outputs (``ar``): Lookup._find_hit's AR search past the hit. The AR key of
     * boundary i covers data[:spans[i][0]]; those up to the base's state cut are the base's
     * (none missing, else the Python path makes them), the others are hashed on from its
     * state. The highest live one is the candidate; its chain is the caller's to read. */
    Py_ssize_t ar_at = -1;
    if (want_ar) {
        Py_ssize_t j;
        if (as_ssize(PyList_GET_ITEM(keyed, pos), &j) < 0) goto fail;
        if (!PyList_Check(r_ar)) DECLINE(TK_AR_KEYS);
        ar_keys = PyList_New(n);
        if (!ar_keys) goto fail;
        for (Py_ssize_t i = 0; i < n; i++) PyList_SET_ITEM(ar_keys, i, Py_NewRef(Py_None));
        Py_ssize_t i = j + 1;
        for (; i < n && i <= r_cut; i++) {
            if (i >= PyList_GET_SIZE(r_ar)) DECLINE(TK_AR_KEYS);
            PyObject *k = PyList_GET_ITEM(r_ar, i);
            if (!PyBytes_Check(k) || PyBytes_GET_SIZE(k) != TK_KEY_SIZE) DECLINE(TK_AR_KEYS);
            PyList_SetItem(ar_keys, i, Py_NewRef(k));
        }
        if (i < n) {
            as = ((TkHasher *)r_hasher)->state;
            Py_ssize_t from = r_off;
            for (; i < n; i++) {
                Py_ssize_t si, ei;
                if (span_at(spans, i, &si, &ei) < 0) goto fail;
                feed(&as, data, from, si);
                if (si > from) from = si;
                PyObject *k = key_of(&as, "\xff" "AR", 3); /* (tokcache.store.keys: _AR_SUFFIX) */
                if (!k) goto fail;
                PyList_SetItem(ar_keys, i, k); /* steals k */
            }
        }
        if (PyObject_GetBuffer(index_obj, &view, PyBUF_SIMPLE) < 0) goto fail;
        have_view = 1;
        if ((uint64_t)view.len < (uint64_t)index_off + n_buckets * TK_BUCKET_SIZE) {
            PyErr_SetString(PyExc_ValueError, "the index does not fit the buffer");
            goto fail;
        }
        const unsigned char *ar_index = (const unsigned char *)view.buf + index_off;
        for (Py_ssize_t r = n - 1; r > j; r--) {
            PyObject *k = PyList_GET_ITEM(ar_keys, r);
            int64_t sl = tk_find_slot(ar_index, n_buckets, (const unsigned char *)PyBytes_AS_STRING(k));
            if (sl >= 0 && tk_slot_live(ar_index + sl, now, tail)) {
                ar_at = r;
                break;
            }
        }
        PyBuffer_Release(&view);
        have_view = 0;
        PyObject_GC_UnTrack(ar_keys);
    }
    /* Lists of ints, (int, int) tuples, bytes or None: in no cycle (see py_untrack). (Spans
       holds no objects: not tracked.) */
    PyObject_GC_UnTrack(tail_list);
    PyObject_GC_UnTrack(keyed);
    PyObject_GC_UnTrack(keys);
    result = Py_BuildValue("(OOOOnnnOOOnOnOOnnOn)", base ? base : Py_None, data, spans, tail_list, tail_from,
                           kept_end, stable, keyed, keys, state, last, exact, pos, key, container, tokens,
                           tail_chars, ar_keys ? ar_keys : Py_None, ar_at);
    goto done;
none:
    result = PyLong_FromLong(declined);
    goto done;
fail:
    result = NULL;
done:
    if (have_view) PyBuffer_Release(&view);
    Py_XDECREF(snapshot);
    Py_XDECREF(base);
    Py_XDECREF(old);
    Py_XDECREF(hashers);
    Py_XDECREF(sub);
    Py_XDECREF(added);
    Py_XDECREF(base_data);
    Py_XDECREF(data);
    Py_XDECREF(base_spans);
    Py_XDECREF(spans);
    Py_XDECREF(tail_list);
    Py_XDECREF(keyed);
    Py_XDECREF(keys);
    Py_XDECREF(state);
    Py_XDECREF(exact);
    Py_XDECREF(ident);
    Py_XDECREF(entry);
    Py_XDECREF(st);
    Py_XDECREF(ar_keys);
    Py_XDECREF(empty);
    return result;
}


/* ---------------------------------------------------------------------------------- */
/* cut_tokens: where the boundary tokens of a text fall in its ids.                    */

PyDoc_STRVAR(cut_tokens_doc,
"cut_tokens(data, spans, i, last, keyed, k, ids, pos, id_of, at) -> None\n\n"
"lookup._cut_tokens' walk (the reference): for spans[i..last], find the span's token id\n"
"(``id_of[data[s:e]]``) in ``ids`` from ``pos`` on; record ``at[e] = position after it``\n"
"for the keyed cuts (``keyed[k:]``, ascending) and the last. Stops where a token is not\n"
"found (``at`` stays as far as it got).");

static PyObject *py_cut_tokens(PyObject *self, PyObject *args) {
    PyObject *data, *spans, *keyed, *ids, *id_of, *at;
    Py_ssize_t i, last, k, pos;
    if (!PyArg_ParseTuple(args, "O!OnnO!nO!nO!O!", &PyBytes_Type, &data, &spans, &i, &last, &PyList_Type, &keyed,
                          &k, &PyList_Type, &ids, &pos, &PyDict_Type, &id_of, &PyDict_Type, &at))
        return NULL;
    if (!Spans_Check(spans) && !PyList_Check(spans)) {
        PyErr_SetString(PyExc_TypeError, "cut_tokens: spans must be a Spans or a list of (start, end)");
        return NULL;
    }
    const char *buf = PyBytes_AS_STRING(data);
    Py_ssize_t len = PyBytes_GET_SIZE(data);
    if (i < 0 || k < 0 || pos < 0) {
        PyErr_SetString(PyExc_ValueError, "cut_tokens: negative index");
        return NULL;
    }
    Py_ssize_t next_keyed = -1;
    for (; i <= last && i < spans_len(spans); i++) {
        Py_ssize_t s, e;
        if (span_at(spans, i, &s, &e) < 0) return NULL;
        if (s < 0 || e < s || e > len) {
            PyErr_SetString(PyExc_ValueError, "cut_tokens: a span outside the data");
            return NULL;
        }
        PyObject *tok = PyBytes_FromStringAndSize(buf + s, e - s);
        if (!tok) return NULL;
        PyObject *want = PyDict_GetItemWithError(id_of, tok); /* borrowed */
        Py_DECREF(tok);
        if (!want) {
            if (PyErr_Occurred()) return NULL;
            break; /* not a boundary token's text (cannot happen): stop */
        }
        long target = PyLong_AsLong(want);
        if (target == -1 && PyErr_Occurred()) return NULL;
        Py_ssize_t n = PyList_GET_SIZE(ids), j = pos;
        for (; j < n; j++) {
            PyObject *item = PyList_GET_ITEM(ids, j);
            if (item == want) break;
            long small;
            if (small_int(item, &small)) {
                if (small == target) break;
            } else if (PyLong_CheckExact(item)) {
                long v = PyLong_AsLong(item);
                if (v == target && !(v == -1 && PyErr_Occurred())) break;
                PyErr_Clear();
            } else {
                int eq = PyObject_RichCompareBool(item, want, Py_EQ);
                if (eq < 0) return NULL;
                if (eq) break;
            }
        }
        if (j >= n) break; /* not found (cannot happen): stop */
        pos = j + 1;
        while (next_keyed < i && k < PyList_GET_SIZE(keyed)) {
            if (as_ssize(PyList_GET_ITEM(keyed, k), &next_keyed) < 0) return NULL;
            if (next_keyed < i) k++;
        }
        if (next_keyed == i || i == last) {
            PyObject *ek = PyLong_FromSsize_t(e), *pv = PyLong_FromSsize_t(pos);
            int r = (ek && pv) ? PyDict_SetItem(at, ek, pv) : -1;
            Py_XDECREF(ek);
            Py_XDECREF(pv);
            if (r < 0) return NULL;
        }
    }
    Py_RETURN_NONE;
}

/* ---------------------------------------------------------------------------------- */
/* common_prefix: how many leading bytes two texts share (a rewritten history's base). */

PyDoc_STRVAR(common_prefix_doc,
"common_prefix(a, b) -> int\n\n"
"The length of the longest common prefix of the bytes-like ``a`` and ``b`` (boundaries.py's\n"
"_common_prefix is the reference).");

static PyObject *py_common_prefix(PyObject *self, PyObject *args) {
    Py_buffer a, b;
    if (!PyArg_ParseTuple(args, "y*y*", &a, &b)) return NULL;
    const unsigned char *p = a.buf, *q = b.buf;
    Py_ssize_t n = a.len < b.len ? a.len : b.len, i = 0;
    /* Whole blocks first (memcmp is vectorised), then the block that differs byte by byte. */
    while (i + 4096 <= n && memcmp(p + i, q + i, 4096) == 0) i += 4096;
    while (i + 64 <= n && memcmp(p + i, q + i, 64) == 0) i += 64;
    while (i < n && p[i] == q[i]) i++;
    PyBuffer_Release(&a);
    PyBuffer_Release(&b);
    return PyLong_FromSsize_t(i);
}

PyDoc_STRVAR(untrack_doc,
"untrack(ids) -> ids: stop the cyclic garbage collector from tracking the list ``ids``,\n"
"which holds ints or tuples of ints only and so can be in no reference cycle. Collections\n"
"then skip it: each one would visit every id of every list a reader keeps (memo chains,\n"
"encodings), touching each int in memory. Refcounting still frees it.");

static PyObject *py_untrack(PyObject *self, PyObject *ids) {
    if (Spans_Check(ids)) { /* holds no objects: never tracked */
        Py_INCREF(ids);
        return ids;
    }
    if (!PyList_CheckExact(ids)) {
        PyErr_SetString(PyExc_TypeError, "untrack: expected a list");
        return NULL;
    }
    PyObject_GC_UnTrack(ids); /* a no-op on an untracked object */
    Py_INCREF(ids);
    return ids;
}


/* ---------------------------------------------------------------------------------- */
/* join: a result list made once, at its final size.                                   */

PyDoc_STRVAR(join_doc,
"join(parts, n, prefix, suffix) -> list\n\n"
"ids.ListFormat.result (the reference): ``prefix``, then the first ``n`` ids of ``parts`` (a\n"
"tuple of (list, length) pairs: the first ``length`` items of each list, in order), then\n"
"``suffix``, as one new list allocated once at its final size. Growing a list part by part\n"
"reallocates it as it grows: a few reallocations of ~120 KB per 57 KB prompt, each a\n"
"malloc that also consolidates the allocator's free small chunks (cold when many processes\n"
"share the cores). ValueError when a part's length exceeds its list's.");

static PyObject *py_join(PyObject *self, PyObject *args) {
    PyObject *parts, *prefix_in, *suffix_in;
    Py_ssize_t n;
    if (!PyArg_ParseTuple(args, "O!nOO", &PyTuple_Type, &parts, &n, &prefix_in, &suffix_in)) return NULL;
    PyObject *prefix = PySequence_Fast(prefix_in, "join: prefix must be a sequence");
    if (prefix == NULL) return NULL;
    PyObject *suffix = PySequence_Fast(suffix_in, "join: suffix must be a sequence");
    if (suffix == NULL) {
        Py_DECREF(prefix);
        return NULL;
    }
    PyObject *out = NULL;
    Py_ssize_t np = PyTuple_GET_SIZE(parts), left = n < 0 ? 0 : n, total = 0, last = 0;
    for (; last < np && left > 0; last++) { /* validate and count: parts[:last] are used */
        PyObject *pair = PyTuple_GET_ITEM(parts, last);
        if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2 || !PyList_Check(PyTuple_GET_ITEM(pair, 0))) {
            PyErr_SetString(PyExc_TypeError, "join: parts must be (list, length) pairs");
            goto done;
        }
        Py_ssize_t ln = PyLong_AsSsize_t(PyTuple_GET_ITEM(pair, 1));
        if (ln == -1 && PyErr_Occurred()) goto done;
        if (ln < 0 || ln > PyList_GET_SIZE(PyTuple_GET_ITEM(pair, 0))) {
            PyErr_SetString(PyExc_ValueError, "join: a part's length exceeds its list");
            goto done;
        }
        Py_ssize_t take = ln < left ? ln : left;
        total += take;
        left -= take;
    }
    Py_ssize_t npre = PySequence_Fast_GET_SIZE(prefix), nsuf = PySequence_Fast_GET_SIZE(suffix);
    Py_ssize_t size = npre + total + nsuf;
    /* The items from PyMem_Malloc, not PyList_New's calloc: every item is written below, so
     * zeroing them first (~120 KB at 57 KB) would touch every page twice. The size is set once
     * they are written (no allocation between, so no collection can see the list half made). */
    out = PyList_New(0);
    if (out == NULL) goto done;
    if (size > 0) {
        PyObject **items = PyMem_New(PyObject *, (size_t)size);
        if (items == NULL) {
            Py_CLEAR(out);
            PyErr_NoMemory();
            goto done;
        }
        ((PyListObject *)out)->ob_item = items;
        ((PyListObject *)out)->allocated = size;
    }
    PyObject **dst = ((PyListObject *)out)->ob_item, **src = PySequence_Fast_ITEMS(prefix);
    for (Py_ssize_t i = 0; i < npre; i++) *dst++ = Py_NewRef(src[i]);
    left = total;
    for (Py_ssize_t k = 0; k < last && left > 0; k++) {
        PyObject *pair = PyTuple_GET_ITEM(parts, k);
        Py_ssize_t ln = PyLong_AsSsize_t(PyTuple_GET_ITEM(pair, 1)), take = ln < left ? ln : left;
        src = ((PyListObject *)PyTuple_GET_ITEM(pair, 0))->ob_item;
        for (Py_ssize_t i = 0; i < take; i++) *dst++ = Py_NewRef(src[i]);
        left -= take;
    }
    src = PySequence_Fast_ITEMS(suffix);
    for (Py_ssize_t i = 0; i < nsuf; i++) *dst++ = Py_NewRef(src[i]);
    Py_SET_SIZE(out, size);
done:
    Py_DECREF(prefix);
    Py_DECREF(suffix);
    return out;
}

/* ---------------------------------------------------------------------------------- */
/* pack, intern, unpack: a client's id lists.                                          */

PyDoc_STRVAR(pack_doc,
"pack(ids) -> bytes\n\n"
"tokcache.ids.pack_ids of a list (the reference: ``array('I', ids)``): its ints as packed\n"
"little-endian uint32, written once into the result. OverflowError for an int outside\n"
"[0, 2**32), TypeError for an item that is not an int. (The array converts each item\n"
"through its generic setter and grows as it goes: ~100 us per 5000-id write.)");

static PyObject *py_pack(PyObject *self, PyObject *ids) {
    if (!PyList_CheckExact(ids)) {
        PyErr_SetString(PyExc_TypeError, "pack: expected a list");
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(ids);
    PyObject *out = PyBytes_FromStringAndSize(NULL, 4 * n);
    if (!out) return NULL;
    unsigned char *dst = (unsigned char *)PyBytes_AS_STRING(out);
    for (Py_ssize_t i = 0; i < n && i < PyList_GET_SIZE(ids); i++) {
        PyObject *item = PyList_GET_ITEM(ids, i);
        long small;
        if (small_int(item, &small) && small >= 0) {
            uint32_t u = (uint32_t)small;
            memcpy(dst + 4 * i, &u, 4);
            continue;
        }
        if (!PyLong_Check(item)) {
            PyErr_Format(PyExc_TypeError, "an integer is required (got type %.200s)", Py_TYPE(item)->tp_name);
            Py_DECREF(out);
            return NULL;
        }
        unsigned long v = PyLong_AsUnsignedLong(item); /* OverflowError for a negative int */
        if (v == (unsigned long)-1 && PyErr_Occurred()) {
            Py_DECREF(out);
            return NULL;
        }
        if (v > 0xFFFFFFFFUL) {
            PyErr_SetString(PyExc_OverflowError, "unsigned int is greater than maximum");
            Py_DECREF(out);
            return NULL;
        }
        uint32_t u = (uint32_t)v;
        memcpy(dst + 4 * i, &u, 4); /* little-endian host (checked at import) */
    }
    return out;
}

PyDoc_STRVAR(intern_doc,
"intern(ids, table) -> ids\n\n"
"tokcache.engine.ids.intern_ids: replace each int of the list ``ids``, in place, by ``table[id]``\n"
"(a list of this process's one object per id value, None where none was made yet: the int\n"
"met first becomes it). Items that are not exact ints in ``range(len(table))`` stay.");

/* A new reference to ``table[v]`` (``v < len(table)``), filed there first when missing: ``have``
 * (an int of value v) if given, else a new int. NULL on error. */
static PyObject *shared_int(PyObject *table, Py_ssize_t v, PyObject *have) {
    PyObject *c = PyList_GET_ITEM(table, v);
    if (c != Py_None) return Py_NewRef(c);
    c = have ? Py_NewRef(have) : PyLong_FromSsize_t(v);
    if (!c) return NULL;
    PyList_SET_ITEM(table, v, Py_NewRef(c));
    Py_DECREF(Py_None); /* the slot's old value */
    return c;
}

static PyObject *py_intern(PyObject *self, PyObject *args) {
    PyObject *ids, *table;
    if (!PyArg_ParseTuple(args, "O!O!", &PyList_Type, &ids, &PyList_Type, &table)) return NULL;
    Py_ssize_t n = PyList_GET_SIZE(ids), m = PyList_GET_SIZE(table);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PyList_GET_ITEM(ids, i);
        long v;
        if (!small_int(item, &v)) {
            if (!PyLong_CheckExact(item)) continue;
            v = PyLong_AsLong(item);
        }
        if (v < 0 || v >= m) {
            PyErr_Clear();
            continue;
        }
        PyObject *c = shared_int(table, v, item); /* cannot fail: ``item`` is filed if none is */
        PyList_SET_ITEM(ids, i, c);
        Py_DECREF(item);
    }
    return Py_NewRef(ids);
}

PyDoc_STRVAR(unpack_doc,
"unpack(data, table, width=4) -> list\n\n"
"tokcache.ids.unpack_ids of packed LE ids ``data``, ``width`` (3 or 4) bytes each (a segment\n"
"stores them 3 wide), its ints taken from ``table`` (made there the first time, see intern)\n"
"rather than made one per id.");

static PyObject *py_unpack(PyObject *self, PyObject *args) {
    Py_buffer in;
    PyObject *table;
    int width = 4;
    if (!PyArg_ParseTuple(args, "y*O!|i", &in, &PyList_Type, &table, &width)) return NULL;
    Py_ssize_t n = (width == 3 || width == 4) ? in.len / width : 0, m = PyList_GET_SIZE(table);
    PyObject *out = NULL;
    if ((width != 3 && width != 4) || in.len % width) {
        PyErr_SetString(PyExc_ValueError, "unpack: data must be packed ids of 3 or 4 bytes (width)");
        goto done;
    }
    out = PyList_New(n);
    if (!out) goto done;
    const unsigned char *src = in.buf;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint32_t v = 0;
        memcpy(&v, src + width * i, (size_t)width);
        PyObject *c = (Py_ssize_t)v < m ? shared_int(table, v, NULL) : PyLong_FromUnsignedLong(v);
        if (!c) {
            Py_CLEAR(out);
            goto done;
        }
        PyList_SET_ITEM(out, i, c);
    }
done:
    PyBuffer_Release(&in);
    return out;
}

/* ---------------------------------------------------------------------------------- */
/* segment_probe: the segment-AR keys of a tail's pieces that the index holds.          */

PyDoc_STRVAR(segment_probe_doc,
"segment_probe(data, spans, first, start, root, index_buffer, index_off, n_buckets, tail, now,\n"
"              min_bytes, header_bytes, max_starts) -> list\n\n"
"Lookup._encode_tail's segment-AR probes: the tail ``data[start:]`` cut at the boundary spans\n"
"``spans[first:]`` into pieces (the bytes before each span, then after the last); for each piece\n"
"of ``min_bytes`` or more, its candidate starts (0, then after each of its first newlines within\n"
"``header_bytes``, at most ``max_starts``, each inside the piece) in order, the segment key of the\n"
"piece from there (``root``, a Hasher fed the namespace's segment header, copied); the first whose\n"
"slot is live (unexpired, at or above ``tail``) is listed as (piece index, start, key). Slots\n"
"are only hints: the caller reads each listed key.");

static PyObject *py_segment_probe(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *data, *spans, *root, *index_obj;
    Py_ssize_t first, start, index_off, min_bytes, header_bytes, max_starts;
    unsigned long long n_buckets, tail;
    double now;
    if (!PyArg_ParseTuple(args, "O!OnnOOnKKdnnn", &PyBytes_Type, &data, &spans, &first, &start, &root, &index_obj,
                          &index_off, &n_buckets, &tail, &now, &min_bytes, &header_bytes, &max_starts))
        return NULL;
    if (!hasher_api || Py_TYPE(root) != hasher_api->type) {
        PyErr_SetString(PyExc_TypeError, "segment_probe: root must be the store extension's Hasher");
        return NULL;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(index_obj, &view, PyBUF_SIMPLE) < 0) return NULL;
    PyObject *out = NULL;
    if (index_off < 0 || n_buckets == 0 || n_buckets > (uint64_t)PY_SSIZE_T_MAX / TK_BUCKET_SIZE ||
        (uint64_t)view.len < (uint64_t)index_off + n_buckets * TK_BUCKET_SIZE) {
        PyErr_SetString(PyExc_ValueError, "the index does not fit the buffer");
        goto done;
    }
    out = PyList_New(0);
    if (!out) goto done;
    const unsigned char *index = (const unsigned char *)view.buf + index_off;
    const unsigned char *d = (const unsigned char *)PyBytes_AS_STRING(data);
    Py_ssize_t total = PyBytes_GET_SIZE(data), n = spans_len(spans), a = start;
    if (first < 0) first = 0;
    for (Py_ssize_t k = 0, i = first; i <= n; i++, k++) {
        Py_ssize_t s_i = total, e_i = total;
        if (i < n && span_at(spans, i, &s_i, &e_i) < 0) goto fail;
        if (s_i < a || s_i > total || e_i < s_i || e_i > total) {
            PyErr_SetString(PyExc_ValueError, "segment_probe: spans out of order");
            goto fail;
        }
        Py_ssize_t len = s_i - a;
        if (len >= min_bytes) {
            Py_ssize_t cand[8], nc = 0;
            cand[nc++] = 0;
            for (Py_ssize_t q = 0; q < len && q < header_bytes && nc < max_starts && nc < 8; q++)
                if (d[a + q] == '\n' && q + 1 < len) cand[nc++] = q + 1;
            for (Py_ssize_t c = 0; c < nc; c++) {
                TkHashState h = ((TkHasher *)root)->state;
                hasher_api->update(&h, d + a + cand[c], (size_t)(len - cand[c]));
                unsigned char key[TK_KEY_SIZE];
                hasher_api->finalize(&h, key, TK_KEY_SIZE);
                int64_t sl = tk_find_slot(index, n_buckets, key);
                if (sl >= 0 && tk_slot_live(index + sl, now, tail)) {
                    PyObject *item = Py_BuildValue("(nny#)", k, cand[c], (const char *)key, (Py_ssize_t)TK_KEY_SIZE);
                    if (!item || PyList_Append(out, item) < 0) {
                        Py_XDECREF(item);
                        goto fail;
                    }
                    Py_DECREF(item);
                    break;
                }
            }
        }
        a = e_i;
    }
    goto done;
fail:
    Py_CLEAR(out);
done:
    PyBuffer_Release(&view);
    return out;
}

/* ---------------------------------------------------------------------------------- */
/* segment_keys: the segment-AR keys of a verified output (record.segment_variants).     */

/* Python's str.isspace for an ASCII byte. */
static inline int ascii_space(unsigned char c) {
    return c == ' ' || (c >= '\t' && c <= '\r') || (c >= 0x1c && c <= 0x1f);
}

/* Whether the UTF-8 sequence at d[i:end] (lead byte >= 0x80) may be a character Python's
 * str.isspace calls whitespace (U+0085, U+00A0, U+1680, U+2000-U+200A, U+2028, U+2029,
 * U+202F, U+205F, U+3000): their lead bytes are 0xC2, 0xE1, 0xE2 and 0xE3. */
static int maybe_unicode_space(const unsigned char *d, Py_ssize_t i, Py_ssize_t end) {
    unsigned char c = d[i];
    if (c == 0xC2) return i + 1 < end && (d[i + 1] == 0x85 || d[i + 1] == 0xA0);
    if (c == 0xE1) return i + 2 < end && d[i + 1] == 0x9A && d[i + 2] == 0x80;
    if (c == 0xE3) return i + 2 < end && d[i + 1] == 0x80 && d[i + 2] == 0x80;
    if (c == 0xE2) {
        if (i + 2 >= end) return 1;
        unsigned char c1 = d[i + 1], c2 = d[i + 2];
        return (c1 == 0x80 && (c2 <= 0x8A || c2 == 0xA8 || c2 == 0xA9 || c2 == 0xAF)) || (c1 == 0x81 && c2 == 0x9F);
    }
    return 0;
}

/* Tokens ending exactly at byte ``off`` of the output (0 at 0; -1 inside a token): the
 * first k with offs[k] >= off, plus one, when offs[k] == off (bisect_left). */
static Py_ssize_t token_at(const uint32_t *offs, Py_ssize_t n, Py_ssize_t off) {
    if (off == 0) return 0;
    Py_ssize_t lo = 0, hi = n;
    while (lo < hi) {
        Py_ssize_t mid = lo + (hi - lo) / 2;
        if ((Py_ssize_t)offs[mid] < off) lo = mid + 1; else hi = mid;
    }
    return (lo < n && (Py_ssize_t)offs[lo] == off) ? lo + 1 : -1;
}

static int span_cmp(const void *x, const void *y) {
    const Py_ssize_t *a = (const Py_ssize_t *)x, *b = (const Py_ssize_t *)y;
    if (a[0] != b[0]) return a[0] < b[0] ? -1 : 1;
    return a[1] < b[1] ? -1 : (a[1] > b[1]);
}

PyDoc_STRVAR(segment_keys_doc,
"segment_keys(data, offsets, spans, root, min_chars) -> list | None\n\n"
"record.segment_variants and the keys Recorder._segments makes of them, for a verified output\n"
"``data`` (UTF-8) whose tokens end at the byte ``offsets`` (packed LE uint32, the last one\n"
"len(data)), cut at the boundary byte spans ``spans``: (key, first token, end token) for each\n"
"variant in (start, end) byte order, those under ``min_chars`` characters left out unless they\n"
"are the whole output; the key is the segment key of the variant's bytes (``root``, a Hasher fed\n"
"the namespace's segment header, copied). None when a piece's edge may be non-ASCII whitespace\n"
"(Python's Unicode strip decides those: the caller uses the reference).");

static PyObject *py_segment_keys(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *data, *offsets, *spans, *root;
    Py_ssize_t min_chars;
    if (!PyArg_ParseTuple(args, "O!O!OOn", &PyBytes_Type, &data, &PyBytes_Type, &offsets, &spans, &root, &min_chars))
        return NULL;
    if (!hasher_api || Py_TYPE(root) != hasher_api->type) {
        PyErr_SetString(PyExc_TypeError, "segment_keys: root must be the store extension's Hasher");
        return NULL;
    }
    if (!PyList_Check(spans) && !Spans_Check(spans)) {
        PyErr_SetString(PyExc_TypeError, "segment_keys: spans must be a list of (start, end)");
        return NULL;
    }
    const unsigned char *d = (const unsigned char *)PyBytes_AS_STRING(data);
    Py_ssize_t total = PyBytes_GET_SIZE(data), n_tok = PyBytes_GET_SIZE(offsets) / 4;
    if (PyBytes_GET_SIZE(offsets) % 4 || n_tok == 0) {
        PyErr_SetString(PyExc_ValueError, "segment_keys: offsets must be packed uint32, at least one");
        return NULL;
    }
    uint32_t *offs = PyMem_Malloc((size_t)n_tok * sizeof(uint32_t));
    Py_ssize_t n = spans_len(spans), cap = 1 + 6 * (n + 1);
    Py_ssize_t *cand = PyMem_Malloc((size_t)cap * 2 * sizeof(Py_ssize_t));
    PyObject *out = NULL;
    if (!offs || !cand) {
        PyErr_NoMemory();
        goto done;
    }
    memcpy(offs, PyBytes_AS_STRING(offsets), (size_t)n_tok * 4);  /* (little-endian hosts only) */
    if ((Py_ssize_t)offs[n_tok - 1] != total) {
        PyErr_SetString(PyExc_ValueError, "segment_keys: the offsets do not end at len(data)");
        goto done;
    }
    Py_ssize_t nc = 0, a = 0;
    cand[nc * 2] = 0, cand[nc * 2 + 1] = total, nc++;
    for (Py_ssize_t i = 0; i <= n; i++) {
        Py_ssize_t s_i = total, e_i = total;
        if (i < n && span_at(spans, i, &s_i, &e_i) < 0) goto done;
        if (s_i < a || e_i < s_i || e_i > total) {
            PyErr_SetString(PyExc_ValueError, "segment_keys: spans out of order");
            goto done;
        }
        /* The piece d[a:s_i]: its heads (0, after leading newlines, after leading whitespace)
         * and tails (its end, before trailing whitespace), in bytes. */
        Py_ssize_t nl = a, ws = a, rt = s_i;
        while (nl < s_i && d[nl] == '\n') nl++;
        while (ws < s_i && d[ws] < 0x80 && ascii_space(d[ws])) ws++;
        if (ws < s_i) {
            if (d[ws] >= 0x80 && maybe_unicode_space(d, ws, s_i)) goto unicode;
            while (rt > ws && d[rt - 1] < 0x80 && ascii_space(d[rt - 1])) rt--;
            if (d[rt - 1] >= 0x80) {
                Py_ssize_t lead = rt - 1;
                while (lead > ws && (d[lead] & 0xC0) == 0x80) lead--;
                if (maybe_unicode_space(d, lead, rt)) goto unicode;
            }
            Py_ssize_t heads[3] = {a, nl, ws}, tails[2] = {s_i, rt};
            for (int h = 0; h < 3; h++)
                for (int t = 0; t < 2; t++)
                    if (heads[h] < tails[t]) cand[nc * 2] = heads[h], cand[nc * 2 + 1] = tails[t], nc++;
        }  /* else whitespace only (in ASCII: a non-ASCII byte would have stopped ws) */
        a = e_i;
    }
    qsort(cand, (size_t)nc, 2 * sizeof(Py_ssize_t), span_cmp);
    out = PyList_New(0);
    if (!out) goto done;
    for (Py_ssize_t c = 0; c < nc; c++) {
        Py_ssize_t ca = cand[c * 2], cb = cand[c * 2 + 1];
        if (c && ca == cand[c * 2 - 2] && cb == cand[c * 2 - 1]) continue;  /* (a set) */
        Py_ssize_t ka = token_at(offs, n_tok, ca), kb = token_at(offs, n_tok, cb);
        if (ka < 0 || kb <= ka) continue;
        if (!(ca == 0 && cb == total)) {
            Py_ssize_t chars = 0;
            for (Py_ssize_t q = ca; q < cb && chars < min_chars; q++) chars += (d[q] & 0xC0) != 0x80;
            if (chars < min_chars) continue;
        }
        TkHashState h = ((TkHasher *)root)->state;
        hasher_api->update(&h, d + ca, (size_t)(cb - ca));
        unsigned char key[TK_KEY_SIZE];
        hasher_api->finalize(&h, key, TK_KEY_SIZE);
        PyObject *item = Py_BuildValue("(y#nn)", (const char *)key, (Py_ssize_t)TK_KEY_SIZE, ka, kb);
        if (!item || PyList_Append(out, item) < 0) {
            Py_XDECREF(item);
            Py_CLEAR(out);
            goto done;
        }
        Py_DECREF(item);
    }
    goto done;
unicode:
    out = Py_NewRef(Py_None);
done:
    PyMem_Free(offs);
    PyMem_Free(cand);
    return out;
}

static PyMethodDef methods[] = {
    {"intern", py_intern, METH_VARARGS, intern_doc},
    {"unpack", py_unpack, METH_VARARGS, unpack_doc},
    {"pack", py_pack, METH_O, pack_doc},
    {"common_prefix", py_common_prefix, METH_VARARGS, common_prefix_doc},
    {"untrack", py_untrack, METH_O, untrack_doc},
    {"cut_tokens", py_cut_tokens, METH_VARARGS, cut_tokens_doc},
    {"extend", py_extend, METH_VARARGS, extend_doc},
    {"join", py_join, METH_VARARGS, join_doc},
    {"segment_probe", py_segment_probe, METH_VARARGS, segment_probe_doc},
    {"segment_keys", py_segment_keys, METH_VARARGS, segment_keys_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "tokcache.engine._speedups",
    "The added-token scan and the steady-state lookup in C (boundaries.py and lookup.py are the\n"
    "references). API: the version of these functions; the Python side uses a build whose API\n"
    "it expects, else its own code (a checkout updated without rebuilding).", -1, methods,
};

PyMODINIT_FUNC PyInit__speedups(void) {
    if (PyType_Ready(&MatcherType) < 0 || PyType_Ready(&SpansType) < 0) return NULL;
    const uint16_t one = 1;
    if (*(const unsigned char *)&one != 1) {
        PyErr_SetString(PyExc_ImportError, "tokcache.engine._speedups assumes a little-endian host");
        return NULL;
    }
#define INTERN(var, str) if (!(var = PyUnicode_InternFromString(str))) return NULL
    INTERN(s_text, "text");
    INTERN(s_data, "data");
    INTERN(s_spans, "spans");
    INTERN(s_stable, "stable");
    INTERN(s_tail_from, "tail_from");
    INTERN(s_kept_end, "kept_end");
    INTERN(s_hashers, "hashers");
    INTERN(s_move_to_end, "move_to_end");
#undef INTERN
    /* (PyCapsule_Import only imports the first part of a dotted name and walks attributes
     * from there: the store extension may not be imported yet) */
    PyObject *store_ext = PyImport_ImportModule("tokcache.store._speedups");
    PyObject *capsule = store_ext ? PyObject_GetAttrString(store_ext, "_hasher_api") : NULL;
    hasher_api = capsule ? (const TkHasherAPI *)PyCapsule_GetPointer(capsule, TK_HASHER_CAPSULE) : NULL;
    Py_XDECREF(capsule);
    Py_XDECREF(store_ext);
    if (!hasher_api) return NULL; /* (the import's or the capsule's error) */
    if (hasher_api->version != TK_HASHER_API_VERSION) {
        PyErr_Format(PyExc_ImportError, "tokcache.engine._speedups needs the hasher API %d of tokcache.store._speedups, "
                     "which has %d: a stale build, reinstall tokcache", TK_HASHER_API_VERSION, hasher_api->version);
        hasher_api = NULL;
        return NULL;
    }
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    if (PyModule_AddFunctions(m, tk_ids_methods) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    Py_INCREF(&MatcherType);
    if (PyModule_AddIntConstant(m, "API", 18) < 0 || PyModule_AddObject(m, "Matcher", (PyObject *)&MatcherType) < 0) {
        Py_DECREF(&MatcherType);
        Py_DECREF(m);
        return NULL;
    }
    Py_INCREF(&SpansType);
    if (PyModule_AddObject(m, "Spans", (PyObject *)&SpansType) < 0) {
        Py_DECREF(&SpansType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
