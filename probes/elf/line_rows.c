/*
 * mtrace-live's reader of DWARF line tables, through elfutils' libdw: a
 * unit's rows, as probes/elf/line_table.py searches them.
 *
 * Why C and libdw: decoding a unit's line program in Python (pyelftools)
 * took up to 0.2 s for one of libpython's, and a summary names frames in
 * dozens of them; libdw decodes all 146 of libpython's units (620,000 rows)
 * in about 0.15 s. Handing its rows to Python one call each (ctypes) would
 * cost 1.6 us a row: they are packed here.
 *
 * Dwarf(path) opens a file's DWARF (OSError: the file cannot be opened;
 * ValueError: libdw finds no DWARF in it). Its methods never fail on what
 * the file holds: what libdw cannot read gives nothing.
 *   aranges() -> bytes: .debug_aranges as (start, end, unit) triples of
 *     native u64, ranges of length 0 left out; b"" without the section or
 *     where it cannot be read.
 *   units() -> bytes: every unit's offset (of its first DIE), native u64.
 *   rows(unit) -> (addresses, places, names): one row per address, by
 *     address: addresses native u64; places (name, line) pairs of native
 *     i32, name -1 where a sequence ended at that address and no row
 *     begins there; names the files' base names, "?" for a file the unit
 *     does not have. libdw gives the rows sorted by address, the ends of
 *     sequences first at an address, then in the line program's order
 *     (elfutils 0.188, libdw/dwarf_getsrclines.c): the last at an address
 *     stands.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <elfutils/libdw.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

typedef struct {
    PyObject_HEAD
    int fd;
    Dwarf *dwarf;
} DwarfObject;

static int dwarf_init(DwarfObject *self, PyObject *args, PyObject *kwargs)
{
    PyObject *path = NULL;
    static char *keywords[] = {"path", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O&", keywords, PyUnicode_FSConverter, &path))
        return -1;
    if (self->dwarf != NULL) {
        PyErr_SetString(PyExc_ValueError, "already open");
        Py_DECREF(path);
        return -1;
    }
    int fd = open(PyBytes_AS_STRING(path), O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        PyErr_SetFromErrnoWithFilename(PyExc_OSError, PyBytes_AS_STRING(path));
        Py_DECREF(path);
        return -1;
    }
    Py_DECREF(path);
    Dwarf *dwarf = dwarf_begin(fd, DWARF_C_READ);
    if (dwarf == NULL) {
        close(fd);
        PyErr_Format(PyExc_ValueError, "no DWARF: %s", dwarf_errmsg(-1));
        return -1;
    }
    self->fd = fd;
    self->dwarf = dwarf;
    return 0;
}

static void dwarf_dealloc(DwarfObject *self)
{
    if (self->dwarf != NULL) {
        dwarf_end(self->dwarf);
        close(self->fd);
    }
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *dwarf_aranges(DwarfObject *self, PyObject *Py_UNUSED(ignored))
{
    Dwarf_Aranges *aranges = NULL;
    size_t count = 0;
    if (self->dwarf == NULL || dwarf_getaranges(self->dwarf, &aranges, &count) != 0
        || aranges == NULL)
        count = 0;
    PyObject *out = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(count * 3 * sizeof(uint64_t)));
    if (out == NULL)
        return NULL;
    uint64_t *triples = (uint64_t *)PyBytes_AS_STRING(out);
    size_t kept = 0;
    for (size_t i = 0; i < count; i++) {
        Dwarf_Addr start;
        Dwarf_Word length;
        Dwarf_Off unit;
        if (dwarf_getarangeinfo(dwarf_onearange(aranges, i), &start, &length, &unit) != 0
            || length == 0)
            continue;
        triples[3 * kept] = start;
        triples[3 * kept + 1] = start + length;
        triples[3 * kept + 2] = unit;
        kept++;
    }
    if (_PyBytes_Resize(&out, (Py_ssize_t)(kept * 3 * sizeof(uint64_t))))
        return NULL;
    return out;
}

static PyObject *dwarf_units(DwarfObject *self, PyObject *Py_UNUSED(ignored))
{
    size_t room = 64, count = 0;
    uint64_t *units = malloc(room * sizeof *units);
    if (units == NULL)
        return PyErr_NoMemory();
    Dwarf_Off offset = 0, next;
    size_t header;
    while (self->dwarf != NULL
           && dwarf_next_unit(self->dwarf, offset, &next, &header, NULL, NULL, NULL, NULL, NULL,
                              NULL) == 0) {
        if (count == room) {
            uint64_t *more = realloc(units, 2 * room * sizeof *units);
            if (more == NULL) {
                free(units);
                return PyErr_NoMemory();
            }
            units = more;
            room *= 2;
        }
        units[count++] = offset + header;
        offset = next;
    }
    PyObject *out = PyBytes_FromStringAndSize((const char *)units,
                                              (Py_ssize_t)(count * sizeof *units));
    free(units);
    return out;
}

/* The files a unit's rows name, each by where libdw keeps its name (a
 * row's dwarf_linesrc), sorted by that pointer to be searched; their base
 * names in the order first met. */
struct name_ref {
    const char *name;
    int32_t index;
};

struct unit_names {
    struct name_ref *refs;
    size_t count, room;
    PyObject *names; /* list of str */
};

static PyObject *base_name(const char *path)
{
    if (path == NULL || strcmp(path, "???") == 0)
        return PyUnicode_FromString("?");
    const char *slash = strrchr(path, '/');
    const char *base = slash != NULL ? slash + 1 : path;
    return PyUnicode_DecodeUTF8(base, (Py_ssize_t)strlen(base), "replace");
}

/* A row's file, as an index into names->names: "?" for none (DWARF < 5
 * has no file 0, which libdw names "???") or one the unit does not have
 * (NULL). -1 on a Python error. */
static int32_t name_index(struct unit_names *names, const char *name)
{
    size_t low = 0, high = names->count;
    while (low < high) {
        size_t middle = low + (high - low) / 2;
        if (names->refs[middle].name == name)
            return names->refs[middle].index;
        if ((uintptr_t)names->refs[middle].name < (uintptr_t)name)
            low = middle + 1;
        else
            high = middle;
    }
    if (names->count == names->room) {
        size_t room = names->room ? 2 * names->room : 16;
        struct name_ref *more = realloc(names->refs, room * sizeof *more);
        if (more == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        names->refs = more;
        names->room = room;
    }
    PyObject *base = base_name(name);
    if (base == NULL || PyList_Append(names->names, base) != 0) {
        Py_XDECREF(base);
        return -1;
    }
    Py_DECREF(base);
    memmove(&names->refs[low + 1], &names->refs[low], (names->count - low) * sizeof *names->refs);
    names->refs[low].name = name;
    names->refs[low].index = (int32_t)(PyList_GET_SIZE(names->names) - 1);
    names->count++;
    return names->refs[low].index;
}

/* The rows into out_addresses and out_places (room for n each); returns
 * how many were kept, -1 on a Python error. */
static Py_ssize_t pack_rows(Dwarf_Lines *lines, size_t n, struct unit_names *names,
                            uint64_t *out_addresses, int32_t *out_places)
{
    Py_ssize_t kept = 0;
    for (size_t i = 0; i < n; i++) {
        Dwarf_Line *line = dwarf_onesrcline(lines, i);
        Dwarf_Addr address;
        bool ended = false;
        int number = 0;
        if (line == NULL || dwarf_lineaddr(line, &address) != 0)
            continue;
        dwarf_lineendsequence(line, &ended);
        /* libdw marks the unit's last row an end of sequence, whatever the
         * program said; as ends come first at an address, a last row that
         * shares its address with the one before begins a line there. */
        if (ended && i == n - 1 && kept > 0 && out_addresses[kept - 1] == address)
            ended = false;
        int32_t name = -1;
        if (!ended) {
            dwarf_lineno(line, &number);
            name = name_index(names, dwarf_linesrc(line, NULL, NULL));
            if (name < 0)
                return -1;
        }
        if (kept > 0 && out_addresses[kept - 1] == address)
            kept--; /* the last row at an address stands */
        out_addresses[kept] = address;
        out_places[2 * kept] = name;
        out_places[2 * kept + 1] = ended ? 0 : number;
        kept++;
    }
    return kept;
}

static PyObject *dwarf_rows(DwarfObject *self, PyObject *args)
{
    unsigned long long offset;
    if (!PyArg_ParseTuple(args, "K", &offset))
        return NULL;
    Dwarf_Die unit;
    Dwarf_Lines *lines = NULL;
    size_t n = 0;
    if (self->dwarf == NULL || dwarf_offdie(self->dwarf, offset, &unit) == NULL
        || dwarf_getsrclines(&unit, &lines, &n) != 0)
        n = 0;
    struct unit_names names = {NULL, 0, 0, PyList_New(0)};
    PyObject *addresses = NULL, *places = NULL;
    if (names.names == NULL)
        goto fail;
    addresses = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(n * sizeof(uint64_t)));
    places = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(n * 2 * sizeof(int32_t)));
    if (addresses == NULL || places == NULL)
        goto fail;
    Py_ssize_t kept = pack_rows(lines, n, &names, (uint64_t *)PyBytes_AS_STRING(addresses),
                                (int32_t *)PyBytes_AS_STRING(places));
    if (kept < 0 || _PyBytes_Resize(&addresses, kept * (Py_ssize_t)sizeof(uint64_t))
        || _PyBytes_Resize(&places, kept * 2 * (Py_ssize_t)sizeof(int32_t)))
        goto fail;
    free(names.refs);
    return Py_BuildValue("NNN", addresses, places, names.names);
fail:
    free(names.refs);
    Py_XDECREF(names.names);
    Py_XDECREF(addresses);
    Py_XDECREF(places);
    return NULL;
}

static PyMethodDef dwarf_methods[] = {
    {"aranges", (PyCFunction)dwarf_aranges, METH_NOARGS, "(start, end, unit) u64 triples."},
    {"units", (PyCFunction)dwarf_units, METH_NOARGS, "Every unit's offset, u64."},
    {"rows", (PyCFunction)dwarf_rows, METH_VARARGS, "(addresses, places, names) of a unit."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject DwarfType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "mtrace_live.probes.elf._lines.Dwarf",
    .tp_basicsize = sizeof(DwarfObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A file's DWARF, open with libdw.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)dwarf_init,
    .tp_dealloc = (destructor)dwarf_dealloc,
    .tp_methods = dwarf_methods,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_lines", "DWARF line tables, read with libdw.", -1, NULL, NULL, NULL,
    NULL, NULL,
};

PyMODINIT_FUNC PyInit__lines(void)
{
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && PyModule_AddType(m, &DwarfType) < 0)
        Py_CLEAR(m);
    return m;
}
