/* Index probes and slot writes in C: the same answers as the Python loops in ``_index.py``,
 * which stay the reference (tests compare the two; TOKCACHE_PURE_PYTHON=1 runs them).
 *
 * A lookup probes up to ~16 keys per request and a writer points ~10 keys per record; in
 * Python each probe is ~1.5 us of interpreter work (a 128-bit modulo, slices, a find),
 * here tens of nanoseconds. Also a write's id narrowing (_layout.narrow), in one pass, and
 * the bytes of a record written in place (_log.write_record) and its keys' slots set in one call
 * (Store._append): a write is rare (one per ~10 requests) but ran ~40 Python calls, and in a
 * busy node's cold caches those cost it ~200 us. Nothing else of the format lives here:
 * where a record goes, eviction and publishing stay in _log.py.
 *
 * The index region is mapped and fully allocated (fallocate + MADV_POPULATE_READ at
 * attach), so reading it through the mapping cannot fault on a hole; writers and readers
 * race without atomics by design: a slot is only a hint, every hit is proven by the
 * record it names (see _layout.py).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "_hasher.h"
#include "_index.h"
#include "_walk.h"

#define KEY_SIZE TK_KEY_SIZE
#define BUCKET_SLOTS TK_BUCKET_SLOTS
#define SLOTS_OFF TK_SLOTS_OFF
#define SLOT_SIZE TK_SLOT_SIZE
#define BUCKET_SIZE TK_BUCKET_SIZE
#define LSN_MASK TK_LSN_MASK
#define load_u64 tk_load_u64
#define load_u32 tk_load_u32
#define buckets tk_buckets

static inline Py_ssize_t find_slot(const unsigned char *index, uint64_t n_buckets, const unsigned char *key) {
    return (Py_ssize_t)tk_find_slot(index, n_buckets, key);
}

/* The index region of ``buf`` as a pointer, checked to hold n_buckets buckets at ``off``. */
static int index_view(PyObject *buf, Py_ssize_t off, uint64_t n_buckets, Py_buffer *view, const unsigned char **index) {
    if (PyObject_GetBuffer(buf, view, PyBUF_SIMPLE) < 0) return -1;
    if (off < 0 || n_buckets == 0 || n_buckets > (uint64_t)PY_SSIZE_T_MAX / BUCKET_SIZE ||
        (uint64_t)view->len < (uint64_t)off + n_buckets * BUCKET_SIZE) {
        PyBuffer_Release(view);
        PyErr_SetString(PyExc_ValueError, "the index does not fit the buffer");
        return -1;
    }
    *index = (const unsigned char *)view->buf + off;
    return 0;
}

static int key_bytes(PyObject *key, const unsigned char **out) {
    if (!PyBytes_Check(key) || PyBytes_GET_SIZE(key) != KEY_SIZE) {
        PyErr_SetString(PyExc_TypeError, "keys must be 16-byte bytes");
        return -1;
    }
    *out = (const unsigned char *)PyBytes_AS_STRING(key);
    return 0;
}

PyDoc_STRVAR(find_doc,
"find(buf, index_off, n_buckets, key) -> int\n\n"
"Absolute offset in ``buf`` of ``key``'s slot, or -1 (Index.find).");

static PyObject *py_find(PyObject *self, PyObject *args) {
    PyObject *buf, *key;
    Py_ssize_t off;
    unsigned long long n_buckets;
    if (!PyArg_ParseTuple(args, "OnKO", &buf, &off, &n_buckets, &key)) return NULL;
    const unsigned char *k;
    if (key_bytes(key, &k) < 0) return NULL;
    Py_buffer view;
    const unsigned char *index;
    if (index_view(buf, off, n_buckets, &view, &index) < 0) return NULL;
    Py_ssize_t s = find_slot(index, n_buckets, k);
    PyBuffer_Release(&view);
    return PyLong_FromSsize_t(s < 0 ? -1 : off + s);
}

PyDoc_STRVAR(last_live_doc,
"last_live(buf, index_off, n_buckets, keys, lo, hi, now, tail) -> int\n\n"
"The highest i in [lo, hi) whose keys[i] has an unexpired slot pointing at or above\n"
"``tail``, or -1 (Index.last_live). ``keys`` is a list of 16-byte bytes.");

static PyObject *py_last_live(PyObject *self, PyObject *args) {
    PyObject *buf, *keys;
    Py_ssize_t off, lo, hi;
    unsigned long long n_buckets, tail;
    double now;
    if (!PyArg_ParseTuple(args, "OnKO!nndK", &buf, &off, &n_buckets, &PyList_Type, &keys, &lo, &hi, &now, &tail))
        return NULL;
    if (lo < 0) lo = 0;
    if (hi > PyList_GET_SIZE(keys)) hi = PyList_GET_SIZE(keys);
    Py_buffer view;
    const unsigned char *index;
    if (index_view(buf, off, n_buckets, &view, &index) < 0) return NULL;
    Py_ssize_t found = -1;
    for (Py_ssize_t i = hi - 1; i >= lo; i--) {
        const unsigned char *k;
        if (key_bytes(PyList_GET_ITEM(keys, i), &k) < 0) {
            PyBuffer_Release(&view);
            return NULL;
        }
        Py_ssize_t s = find_slot(index, n_buckets, k);
        if (s < 0) continue;
        if (tk_slot_live(index + s, now, tail)) {
            found = i;
            break;
        }
    }
    PyBuffer_Release(&view);
    return PyLong_FromSsize_t(found);
}

static inline void store_u64(unsigned char *p, uint64_t v) { memcpy(p, &v, 8); }
static inline void store_u32(unsigned char *p, uint32_t v) { memcpy(p, &v, 4); }

PyDoc_STRVAR(set_slot_doc,
"set_slot(buf, index_off, n_buckets, key, lsn_kind, expiry, access, tail, head, now) -> bool\n\n"
"Point ``key`` at a record (Index.set; the writer lock is held): its existing slot, else a\n"
"free one, else a dead one (below tail, at or above head, expired), first bucket first,\n"
"else the least recently read slot of both buckets. True when a live slot was evicted.");

/* Index.set for one key in ``index`` (the writer lock is held): 1 when a live slot was evicted. */
static int set_one(unsigned char *index, uint64_t n_buckets, const unsigned char *k, uint64_t lsn_kind,
                   uint32_t expiry, uint32_t access, uint64_t tail, uint64_t head, double now) {
    int evicted = 0;
    unsigned char *slot = NULL, *tagp = NULL;
    Py_ssize_t s = find_slot(index, n_buckets, k);
    if (s >= 0) {
        slot = index + s; /* same key, same tag */
    } else {
        uint64_t b[2];
        buckets(k, n_buckets, &b[0], &b[1]);
        int nb = b[1] == b[0] ? 1 : 2;
        for (int j = 0; j < nb && !slot; j++) {
            unsigned char *bucket = index + b[j] * BUCKET_SIZE;
            for (int i = 0; i < BUCKET_SLOTS; i++) {
                if (bucket[i] == 0) {
                    slot = bucket + SLOTS_OFF + i * SLOT_SIZE;
                    tagp = bucket + i;
                    break;
                }
            }
        }
        if (!slot) {
            /* No free slot: a dead one, first bucket first; else the least recently read
             * (then oldest) of both buckets -- _index._victim's order exactly. */
            int have = 0;
            uint64_t best_access = 0, best_lsn = 0;
            unsigned char *best_slot = NULL, *best_tag = NULL;
            for (int j = 0; j < nb && !slot; j++) {
                unsigned char *bucket = index + b[j] * BUCKET_SIZE;
                int bhave = 0;
                uint64_t ba = 0, bl = 0;
                unsigned char *bs = NULL, *bt = NULL;
                for (int i = 0; i < BUCKET_SLOTS; i++) {
                    unsigned char *cand = bucket + SLOTS_OFF + i * SLOT_SIZE;
                    uint64_t lsn = load_u64(cand + KEY_SIZE) & LSN_MASK;
                    uint32_t exp = load_u32(cand + KEY_SIZE + 8);
                    uint32_t acc = load_u32(cand + KEY_SIZE + 12);
                    if (lsn < tail || lsn >= head || (exp && now >= (double)exp)) {
                        slot = cand;
                        tagp = bucket + i;
                        break;
                    }
                    if (!bhave || acc < ba || (acc == ba && lsn < bl)) {
                        bhave = 1, ba = acc, bl = lsn, bs = cand, bt = bucket + i;
                    }
                }
                if (!slot && (!have || ba < best_access || (ba == best_access && bl < best_lsn))) {
                    have = 1, best_access = ba, best_lsn = bl, best_slot = bs, best_tag = bt;
                }
            }
            if (!slot) {
                slot = best_slot;
                tagp = best_tag;
                evicted = 1;
            }
        }
    }
    /* Slot before tag: a reader that matches the new tag finds the new slot; readers that
     * see the old tag compare keys and miss. */
    memcpy(slot, k, KEY_SIZE);
    store_u64(slot + KEY_SIZE, lsn_kind);
    store_u32(slot + KEY_SIZE + 8, expiry);
    store_u32(slot + KEY_SIZE + 12, access);
    if (tagp) {
        unsigned char tag = k[7] ^ k[15];
        __atomic_thread_fence(__ATOMIC_RELEASE);
        *tagp = tag ? tag : 1;
    }
    return evicted;
}

/* The writable index region of ``buf`` (n_buckets buckets at ``off``), or NULL with an exception. */
static unsigned char *index_region(PyObject *buf, Py_ssize_t off, uint64_t n_buckets, Py_buffer *view) {
    if (PyObject_GetBuffer(buf, view, PyBUF_WRITABLE) < 0) return NULL;
    if (off < 0 || n_buckets == 0 || n_buckets > (uint64_t)PY_SSIZE_T_MAX / BUCKET_SIZE ||
        (uint64_t)view->len < (uint64_t)off + n_buckets * BUCKET_SIZE) {
        PyBuffer_Release(view);
        PyErr_SetString(PyExc_ValueError, "the index does not fit the buffer");
        return NULL;
    }
    return (unsigned char *)view->buf + off;
}

static PyObject *py_set_slot(PyObject *self, PyObject *args) {
    PyObject *buf, *key;
    Py_ssize_t off;
    unsigned long long n_buckets, lsn_kind, tail, head;
    unsigned int expiry, access;
    double now;
    if (!PyArg_ParseTuple(args, "OnKOKIIKKd", &buf, &off, &n_buckets, &key, &lsn_kind, &expiry, &access, &tail,
                          &head, &now))
        return NULL;
    const unsigned char *k;
    if (key_bytes(key, &k) < 0) return NULL;
    Py_buffer view;
    unsigned char *index = index_region(buf, off, n_buckets, &view);
    if (!index) return NULL;
    int evicted = set_one(index, n_buckets, k, lsn_kind, expiry, access, tail, head, now);
    PyBuffer_Release(&view);
    return PyBool_FromLong(evicted);
}

/* One record entry (key, n, kind, expiry, start), checked: 0, or -1 with an exception. */
static int entry_fields(PyObject *entry, const unsigned char **key, uint32_t *n, uint8_t *kind, uint32_t *expiry,
                        uint32_t *start) {
    if (!PyTuple_Check(entry) || PyTuple_GET_SIZE(entry) != 5) {
        PyErr_SetString(PyExc_TypeError, "entries must be (key, n, kind, expiry, start) tuples");
        return -1;
    }
    if (key_bytes(PyTuple_GET_ITEM(entry, 0), key) < 0) return -1;
    unsigned long long v[4];
    for (int i = 0; i < 4; i++) {
        v[i] = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(entry, i + 1));
        if (v[i] == (unsigned long long)-1 && PyErr_Occurred()) return -1;
    }
    if (v[0] > UINT32_MAX || v[1] > 0xFF || v[2] > UINT32_MAX || v[3] > 0xFFFFFF) {
        PyErr_SetString(PyExc_OverflowError, "an entry field does not fit the record");
        return -1;
    }
    *n = (uint32_t)v[0], *kind = (uint8_t)v[1], *expiry = (uint32_t)v[2], *start = (uint32_t)v[3];
    return 0;
}

PyDoc_STRVAR(set_slots_doc,
"set_slots(buf, index_off, n_buckets, entries, lsn, access, tail, head, now) -> int\n\n"
"set_slot for each (key, n, kind, expiry, start) of ``entries`` in order, pointing it at record ``lsn``\n"
"as ``kind << 56 | lsn`` with its expiry (Store._append's loop). The live slots evicted.");

static PyObject *py_set_slots(PyObject *self, PyObject *args) {
    PyObject *buf, *entries;
    Py_ssize_t off;
    unsigned long long n_buckets, lsn, tail, head;
    unsigned int access;
    double now;
    if (!PyArg_ParseTuple(args, "OnKO!KIKKd", &buf, &off, &n_buckets, &PyList_Type, &entries, &lsn, &access, &tail,
                          &head, &now))
        return NULL;
    if (lsn > LSN_MASK) {
        PyErr_SetString(PyExc_OverflowError, "lsn does not fit 56 bits");
        return NULL;
    }
    Py_buffer view;
    unsigned char *index = index_region(buf, off, n_buckets, &view);
    if (!index) return NULL;
    long evicted = 0;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(entries); i++) {
        const unsigned char *k;
        uint32_t n, expiry, start;
        uint8_t kind;
        if (entry_fields(PyList_GET_ITEM(entries, i), &k, &n, &kind, &expiry, &start) < 0) {
            PyBuffer_Release(&view);
            return NULL;
        }
        evicted += set_one(index, n_buckets, k, (uint64_t)kind << 56 | lsn, expiry, access, tail, head, now);
    }
    PyBuffer_Release(&view);
    return PyLong_FromLong(evicted);
}

/* The record header (_layout.RECORD, "<16sIIQQ8sIIIHBBIIQ") and entry (ENTRY, "<16sIIBHB"). */
#define RECORD_SIZE 80
#define ENTRY_SIZE 28
#define CHECK_SIZE 16
#define LINK_CHECK_SIZE 8

PyDoc_STRVAR(write_record_doc,
"write_record(buf, start, size, lsn, parent_lsn, parent_check, parent_n, base, n_ids, kind, flags,\n"
"             expiry, parent_size, floor, entries, ids) -> None\n\n"
"_log.write_record's Python (the reference), in C: the ``size`` bytes of one record at ``start`` of\n"
"``buf`` -- header (magic, ``len(entries)``), the (key, n, kind, expiry, start) entries, the stored\n"
"``ids``, zero padding -- then its SHA-256 check. No copy of the record is made.");

static PyObject *py_write_record(PyObject *self, PyObject *args) {
    PyObject *buf, *entries;
    Py_ssize_t start, size;
    unsigned long long lsn, parent_lsn, floor;
    Py_buffer pcheck, ids;
    unsigned int parent_n, base, n_ids, expiry, parent_size;
    unsigned char kind, flags;
    if (!PyArg_ParseTuple(args, "OnnKKy*IIIbbIIKO!y*", &buf, &start, &size, &lsn, &parent_lsn, &pcheck, &parent_n,
                          &base, &n_ids, &kind, &flags, &expiry, &parent_size, &floor, &PyList_Type, &entries, &ids))
        return NULL;
    PyObject *out = NULL;
    Py_buffer view = {0};
    Py_ssize_t n_entries = PyList_GET_SIZE(entries);
    if (pcheck.len != LINK_CHECK_SIZE || n_entries > 0xFFFF || size < 0 || (unsigned long long)size > UINT32_MAX ||
        RECORD_SIZE + ENTRY_SIZE * n_entries + ids.len > size) {
        PyErr_SetString(PyExc_ValueError, "write_record: the record's parts do not fit its size");
        goto done;
    }
    if (PyObject_GetBuffer(buf, &view, PyBUF_WRITABLE) < 0) goto done;
    if (start < 0 || start > view.len - size) {
        PyErr_SetString(PyExc_ValueError, "write_record: the record does not fit the buffer");
        goto done;
    }
    unsigned char *rec = (unsigned char *)view.buf + start;
    /* Entries first, checked before a byte is written: a bad one leaves the buffer as it was. */
    for (Py_ssize_t i = 0; i < n_entries; i++) {
        const unsigned char *k;
        uint32_t n, e, st;
        uint8_t kd;
        if (entry_fields(PyList_GET_ITEM(entries, i), &k, &n, &kd, &e, &st) < 0) goto done;
    }
    memset(rec, 0, RECORD_SIZE);
    store_u32(rec + 16, 0x31524b54u); /* b"TKR1" */
    store_u32(rec + 20, (uint32_t)size);
    store_u64(rec + 24, lsn);
    store_u64(rec + 32, parent_lsn);
    memcpy(rec + 40, pcheck.buf, LINK_CHECK_SIZE);
    store_u32(rec + 48, parent_n);
    store_u32(rec + 52, base);
    store_u32(rec + 56, n_ids);
    uint16_t ne = (uint16_t)n_entries;
    memcpy(rec + 60, &ne, 2);
    rec[62] = kind;
    rec[63] = flags;
    store_u32(rec + 64, expiry);
    store_u32(rec + 68, parent_size);
    store_u64(rec + 72, floor);
    unsigned char *p = rec + RECORD_SIZE;
    for (Py_ssize_t i = 0; i < n_entries; i++, p += ENTRY_SIZE) {
        const unsigned char *k;
        uint32_t n, e, st;
        uint8_t kd;
        entry_fields(PyList_GET_ITEM(entries, i), &k, &n, &kd, &e, &st); /* checked above */
        memcpy(p, k, KEY_SIZE);
        store_u32(p + 16, n);
        store_u32(p + 20, e);
        p[24] = kd;
        p[25] = (unsigned char)(st & 0xFF);
        p[26] = (unsigned char)((st >> 8) & 0xFF);
        p[27] = (unsigned char)(st >> 16);
    }
    memcpy(p, ids.buf, ids.len);
    p += ids.len;
    memset(p, 0, (size_t)(rec + size - p));
    /* (not the one-shot SHA256(): in OpenSSL 3 it fetches the algorithm on every call) */
    TkHashState h;
    unsigned char md[TK_DIGEST_SIZE];
    SHA256_Init(&h);
    SHA256_Update(&h, rec + CHECK_SIZE, (size_t)size - CHECK_SIZE);
    SHA256_Final(md, &h);
    memcpy(rec, md, CHECK_SIZE);
    out = Py_NewRef(Py_None);
done:
    if (view.obj) PyBuffer_Release(&view);
    PyBuffer_Release(&pcheck);
    PyBuffer_Release(&ids);
    return out;
}

PyDoc_STRVAR(narrow_doc,
"narrow(ids, id_bytes) -> bytes | None\n\n"
"_layout.narrow (the reference): packed LE u32 ``ids`` as ``id_bytes``-wide LE ids (3 or 4), or\n"
"None when an id does not fit. One pass (the extended-slice copies are five, ~75 us for 5000 ids).");

static PyObject *py_narrow(PyObject *self, PyObject *args) {
    Py_buffer in;
    int width;
    if (!PyArg_ParseTuple(args, "y*i", &in, &width)) return NULL;
    PyObject *out = NULL;
    if (in.len % 4) {
        PyErr_SetString(PyExc_ValueError, "narrow: ids must be packed uint32");
        goto done;
    }
    if (width == 4) {
        out = PyBytes_FromStringAndSize(in.buf, in.len);
        goto done;
    }
    if (width != 3) {
        PyErr_SetString(PyExc_ValueError, "narrow: id_bytes must be 3 or 4");
        goto done;
    }
    Py_ssize_t n = in.len / 4;
    const unsigned char *src = in.buf;
    for (Py_ssize_t i = 0; i < n; i++)
        if (src[4 * i + 3]) {
            out = Py_NewRef(Py_None);
            goto done;
        }
    out = PyBytes_FromStringAndSize(NULL, 3 * n);
    if (!out) goto done;
    unsigned char *dst = (unsigned char *)PyBytes_AS_STRING(out);
    for (Py_ssize_t i = 0; i < n; i++) {
        dst[3 * i] = src[4 * i];
        dst[3 * i + 1] = src[4 * i + 1];
        dst[3 * i + 2] = src[4 * i + 2];
    }
done:
    PyBuffer_Release(&in);
    return out;
}

static PyMethodDef methods[] = {
    {"narrow", py_narrow, METH_VARARGS, narrow_doc},
    {"set_slot", py_set_slot, METH_VARARGS, set_slot_doc},
    {"set_slots", py_set_slots, METH_VARARGS, set_slots_doc},
    {"write_record", py_write_record, METH_VARARGS, write_record_doc},
    {"find", py_find, METH_VARARGS, find_doc},
    {"last_live", py_last_live, METH_VARARGS, last_live_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "tokcache.store._speedups",
    "Index probes and slot writes in C (_index.py is the reference), and Hasher: SHA-256 for\n"
    "keys (_hasher.c). API: the version of these\n"
    "functions (see tokcache.engine._speedups).", -1, methods,
};

PyMODINIT_FUNC PyInit__speedups(void) {
    const uint16_t one = 1;
    if (*(const unsigned char *)&one != 1) {
        PyErr_SetString(PyExc_ImportError, "tokcache.store._speedups assumes a little-endian host");
        return NULL;
    }
    PyObject *m = PyModule_Create(&module);
    if (m && (PyModule_AddFunctions(m, tk_walk_methods) < 0 || PyModule_AddIntConstant(m, "API", 6) < 0 ||
              tk_hasher_add(m) < 0))
        Py_CLEAR(m);
    return m;
}
