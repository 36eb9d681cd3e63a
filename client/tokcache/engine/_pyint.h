/* Reading a Python int in place (the engine extension's C files share it). */
#ifndef TK_PYINT_H
#define TK_PYINT_H

#include <Python.h>
#if PY_VERSION_HEX < 0x030B0000
#include <longintrepr.h> /* 3.10: ob_digit (Python.h includes it from 3.11 on) */
#endif

/* The value of an exact int of one digit, read in place: 1 and ``*v``, else 0 (the caller
 * converts it the general way). One digit: 0 <= v < 2**30 on 3.10/3.11, |v| < 2**30 from 3.12
 * (compact ints); callers check the range they need. A token id list is walked item by item,
 * and PyLong_AsLong's checks and call were most of a 4000-id walk (~4 ns an id). */
static inline int small_int(PyObject *o, long *v) {
    if (!PyLong_CheckExact(o)) return 0;
#if PY_VERSION_HEX >= 0x030C0000
    if (!PyUnstable_Long_IsCompact((PyLongObject *)o)) return 0;
    *v = (long)PyUnstable_Long_CompactValue((PyLongObject *)o);
    return 1;
#else
    Py_ssize_t size = Py_SIZE(o);
    if (size == 0) {
        *v = 0;
        return 1;
    }
    if (size != 1) return 0;
    *v = (long)((PyLongObject *)o)->ob_digit[0];
    return 1;
#endif
}

#endif
