/*
 * mtrace-live's batches of bpf(2) calls: one command made for each of many
 * attributes, in order, the interpreter lock let go once for all of them.
 *
 * Why (docs/performance.md, section 12): a warm start makes its program's
 * 69 maps on a thread of its own while the main thread imports and plans
 * (tracer/bpf/preload.py). Made through ctypes, each map's call let the
 * interpreter lock go and then waited to take it back from the busy main
 * thread: a small map's 0.6 ms became 1.5 to 2 ms, and the maps took about
 * 80 ms of a start. In one call, the thread takes the lock back once: 42 to
 * 48 ms.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <sys/syscall.h>
#include <unistd.h>

PyDoc_STRVAR(calls_doc,
"calls(cmd, attrs) -> list[int]\n\n"
"bpf(cmd, attr, len(attr)) for each writable buffer of ``attrs``, in order,\n"
"without the interpreter lock: each call's result (an fd, or 0), or minus\n"
"its errno where it failed. Every call is made, whatever the others gave.");

static PyObject *calls(PyObject *self, PyObject *args)
{
    int cmd;
    PyObject *given;
    if (!PyArg_ParseTuple(args, "iO:calls", &cmd, &given))
        return NULL;
    PyObject *items = PySequence_Fast(given, "attrs must be a sequence of buffers");
    if (!items)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(items);
    Py_buffer *views = PyMem_Calloc(n ? n : 1, sizeof(Py_buffer));
    long *results = PyMem_Calloc(n ? n : 1, sizeof(long));
    PyObject *out = NULL;
    Py_ssize_t held = 0;
    if (!views || !results) {
        PyErr_NoMemory();
        goto done;
    }
    for (; held < n; held++) {
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(items, held), &views[held],
                               PyBUF_WRITABLE) < 0)
            goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) {
        long r = syscall(SYS_bpf, cmd, views[i].buf, (unsigned int)views[i].len);
        results[i] = r < 0 ? -(long)errno : r;
    }
    Py_END_ALLOW_THREADS
    out = PyList_New(n);
    if (!out)
        goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *value = PyLong_FromLong(results[i]);
        if (!value) {
            Py_CLEAR(out);
            goto done;
        }
        PyList_SET_ITEM(out, i, value);
    }
done:
    if (views) {
        for (Py_ssize_t i = 0; i < held; i++)
            PyBuffer_Release(&views[i]);
    }
    PyMem_Free(views);
    PyMem_Free(results);
    Py_DECREF(items);
    return out;
}

static PyMethodDef methods[] = {
    {"calls", calls, METH_VARARGS, calls_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_bpf_batch",
    "Batches of bpf(2) calls made without the interpreter lock (tracer/bpf/bpf_batch.c).",
    -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__bpf_batch(void)
{
    return PyModule_Create(&module);
}
