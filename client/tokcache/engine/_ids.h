/* Token id sequences for recording an output (token_bytes, equal_ids: see _ids.c), for
 * _speedups' method table. */
#ifndef TK_IDS_H
#define TK_IDS_H

#include <Python.h>

extern PyMethodDef tk_ids_methods[];

#endif
