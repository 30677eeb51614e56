/* The format-version-2 checkpoint checksum's inner loop in C (app/checkpoint/slabs.py has the
 * definition and the NumPy version it must equal):
 *
 *   rows(values, itemsize, bases, row_len) = sum over rows r and k < row_len of
 *       mix64(mix64(K + (bases[r] + k) G) XOR u[r row_len + k])   mod 2^64
 *
 * with u the elements' bit patterns (itemsize 1, 2, 4 or 8 bytes, zero-extended) and bases[r] the
 * global row-major index of row r's first element. NumPy spends about 21 whole-array passes per
 * 64K-element chunk on it; here it is one pass, with the GIL released (a save's checksums may run
 * beside other Python threads). The same pass counts the elements whose exponent bits are all set
 * (Inf or NaN) when given the mask: a save checks its values for them before it writes.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

#define GOLDEN 0x9E3779B97F4A7C15ULL
#define SEED 0x6A09E667F3BCC909ULL

static inline uint64_t mix64(uint64_t z) {
  z ^= z >> 30;
  z *= 0xBF58476D1CE4E5B9ULL;
  z ^= z >> 27;
  z *= 0x94D049BB133111EBULL;
  z ^= z >> 31;
  return z;
}

#define ROWS_LOOP(TYPE)                                                  \
  for (Py_ssize_t r = 0; r < nrows; r++) {                               \
    const TYPE *u = (const TYPE *)values + r * row_len;                  \
    uint64_t s = SEED + base[r] * GOLDEN;                                \
    if (mask) {                                                          \
      for (Py_ssize_t k = 0; k < row_len; k++, s += GOLDEN) {            \
        total += mix64(mix64(s) ^ (uint64_t)u[k]);                       \
        bad += ((uint64_t)u[k] & mask) == mask;                          \
      }                                                                  \
    } else {                                                             \
      for (Py_ssize_t k = 0; k < row_len; k++, s += GOLDEN)              \
        total += mix64(mix64(s) ^ (uint64_t)u[k]);                       \
    }                                                                    \
  }

/* x86-64: a clone per instruction set, chosen at load time (GCC's ifunc): AVX-512 has 64-bit
 * vector multiplies, 2.3x the scalar loop on an AVX-512 Xeon; -march=native would tie the build
 * to the machine that compiled it (a login node, not the compute nodes). */
#if defined(__x86_64__) && defined(__has_attribute)
#if __has_attribute(target_clones)
__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#endif
#endif
static uint64_t rows_sum(const void *values, int itemsize, const uint64_t *base, Py_ssize_t nrows,
                         Py_ssize_t row_len, uint64_t mask, uint64_t *bad_out) {
  uint64_t total = 0, bad = 0;
  switch (itemsize) {
    case 1: ROWS_LOOP(uint8_t) break;
    case 2: ROWS_LOOP(uint16_t) break;
    case 4: ROWS_LOOP(uint32_t) break;
    default: ROWS_LOOP(uint64_t) break;
  }
  *bad_out = bad;
  return total;
}

static PyObject *rows(PyObject *self, PyObject *args) {
  Py_buffer values, bases;
  int itemsize;
  Py_ssize_t row_len;
  unsigned long long mask = 0;
  if (!PyArg_ParseTuple(args, "y*iy*n|K", &values, &itemsize, &bases, &row_len, &mask)) return NULL;
  PyObject *out = NULL;
  Py_ssize_t nrows = bases.len / (Py_ssize_t)sizeof(uint64_t);
  if (itemsize != 1 && itemsize != 2 && itemsize != 4 && itemsize != 8) {
    PyErr_Format(PyExc_ValueError, "itemsize %d: expected 1, 2, 4 or 8", itemsize);
  } else if (row_len < 0 || bases.len % (Py_ssize_t)sizeof(uint64_t) ||
             values.len != nrows * row_len * itemsize) {
    PyErr_Format(PyExc_ValueError, "%zd bytes of values are not %zd rows of %zd elements of %d bytes",
                 values.len, nrows, row_len, itemsize);
  } else {
    uint64_t total, bad;
    Py_BEGIN_ALLOW_THREADS;
    total = rows_sum(values.buf, itemsize, (const uint64_t *)bases.buf, nrows, row_len, (uint64_t)mask, &bad);
    Py_END_ALLOW_THREADS;
    out = Py_BuildValue("(KK)", (unsigned long long)total, (unsigned long long)bad);
  }
  PyBuffer_Release(&values);
  PyBuffer_Release(&bases);
  return out;
}

static PyMethodDef methods[] = {
    {"rows", rows, METH_VARARGS,
     "rows(values, itemsize, bases, row_len, mask=0) -> (sum, bad): the v2 checksum's partial sum of "
     "len(bases) rows of row_len elements (values: their bytes, C order; bases: uint64 global index of "
     "each row's first element), and how many elements have every bit of mask set (a float's exponent "
     "all ones: Inf or NaN; 0: not counted)"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_checksum",
                                    "The v2 checkpoint checksum's inner loop (slabs.py).", -1, methods};

PyMODINIT_FUNC PyInit__checksum(void) { return PyModule_Create(&module); }
