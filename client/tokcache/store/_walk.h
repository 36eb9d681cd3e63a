/* The chain walk (see _walk.c), for _speedups' method table. */
#ifndef TK_WALK_H
#define TK_WALK_H

#include <Python.h>

extern PyMethodDef tk_walk_methods[];

#endif
