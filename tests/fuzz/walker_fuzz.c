/*
 * The kmemtrace walker (exporters/kmemtrace/walker.c) fuzzed natively:
 * built with clang's libFuzzer, AddressSanitizer and UndefinedBehaviorSanitizer
 * (tests/fuzz/native.py, `make fuzz-native`), so that the C code every
 * untrusted record set goes through gets coverage feedback and memory checks.
 *
 * The walker is compiled into this program whole (#include), and each input
 * goes through its three entry points as the Python side calls them:
 *   - scan() of each cpuN file, into buffers sized as reader.py sizes them;
 *   - report_records() over the records scan decoded, in the order found;
 *   - report_pass() over the same files, read in small chunks (so that
 *     records cross chunk boundaries), merged by sequence number.
 * An input: one byte of flags (bit 0: big-endian; bits 1-7: the chunk size,
 * 24 + 8 x n bytes), then the cpuN files' contents separated by SEPARATOR,
 * as tests/unit/fuzz_targets.py separates a record set's files.
 *
 * The only errors the walker may raise are OSError (a file it cannot read)
 * and MemoryError: any other aborts, as a crash would. With WALKER_FUZZ_SHOW
 * set in its environment, the harness writes each input's record counts to
 * stderr (tests/unit/test_native_fuzz.py checks the seeds' counts).
 */
#include "../../exporters/kmemtrace/walker.c"

#include <sys/mman.h>

#define SEPARATOR "\n--mtrace-live--\n"
#define MAX_FILES 8
#define RECORD_MIN 24 /* the smallest record: reader.py's CORE_SIZE */
#define PROBE_MIN 80  /* the smallest probe record: reader.py's PROBE_SIZE */

static int show;

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc;
    (void)argv;
    show = getenv("WALKER_FUZZ_SHOW") != NULL;
    /* Every object the interpreter makes comes from malloc, not from
     * pymalloc's arenas (which LeakSanitizer does not scan): the objects the
     * interpreter still holds at exit are reachable from its globals, and an
     * object the walker forgets to release (one the garbage collector does
     * not track) is a leak found, not hidden (tests/fuzz/lsan.supp). */
    PyPreConfig pre;
    PyPreConfig_InitPythonConfig(&pre);
    pre.allocator = PYMEM_ALLOCATOR_MALLOC;
    if (PyStatus_Exception(Py_PreInitialize(&pre))) abort();
    Py_InitializeEx(0);
    return 0;
}

/* The records a pass found, or -1 where it refused the input. A refusal is a
 * read error (OSError) or no memory (MemoryError); any other error is the
 * walker's bug, and aborts. The figures must bound themselves by the input: a
 * record is 24 bytes at least, so no pass can find more records than that. */
static long long check_records(PyObject *found, size_t bytes) {
    if (!found) {
        if (!PyErr_Occurred()) {
            fprintf(stderr, "walker: a NULL result without an error\n");
            abort();
        }
        if (!PyErr_ExceptionMatches(PyExc_OSError) && !PyErr_ExceptionMatches(PyExc_MemoryError)) {
            PyErr_Print();
            abort();
        }
        PyErr_Clear();
        return -1;
    }
    PyObject *records = PyDict_GetItemString(found, "records");
    unsigned long long count = records ? PyLong_AsUnsignedLongLong(records) : ~0ULL;
    if (!records || PyErr_Occurred() || count > bytes / RECORD_MIN) abort();
    Py_DECREF(found);
    return (long long)count;
}

/* One cpuN file: scan() into room sized as reader.py sizes it, and the
 * decoded records appended to ``all``. */
static void scan_file(const uint8_t *data, size_t n, int big, unsigned cpu, PyObject *all) {
    PyObject *in = PyBytes_FromStringAndSize((const char *)data, (Py_ssize_t)n);
    PyObject *out = PyByteArray_FromStringAndSize(NULL, (Py_ssize_t)(n / RECORD_MIN * sizeof(rec_t)));
    PyObject *args = PyByteArray_FromStringAndSize(
        NULL, (Py_ssize_t)((n / PROBE_MIN + 1) * MAX_ARGS * sizeof(uint64_t)));
    PyObject *skipped = PyByteArray_FromStringAndSize(NULL, 4 * sizeof(int64_t));
    if (!in || !out || !args || !skipped) abort();
    memset(PyByteArray_AS_STRING(skipped), 0, 4 * sizeof(int64_t));
    PyObject *call = Py_BuildValue("(OiIOOO)", in, big, cpu, out, args, skipped);
    PyObject *got = scan(NULL, call);
    Py_ssize_t count, probes, offset, status;
    if (!got || !PyArg_ParseTuple(got, "nnnn", &count, &probes, &offset, &status)) abort();
    if (count < 0 || (size_t)count > n / RECORD_MIN || probes > count || offset < 0 ||
        (size_t)offset > n || status < 0 || status > 2)
        abort();
    Py_ssize_t had = PyByteArray_GET_SIZE(all), adds = count * (Py_ssize_t)sizeof(rec_t);
    if (PyByteArray_Resize(all, had + adds) < 0) abort();
    memcpy(PyByteArray_AS_STRING(all) + had, PyByteArray_AS_STRING(out), (size_t)adds);
    Py_DECREF(got);
    Py_DECREF(call);
    Py_DECREF(in);
    Py_DECREF(out);
    Py_DECREF(args);
    Py_DECREF(skipped);
}

static int memfd_of(const uint8_t *data, size_t n) {
    int fd = memfd_create("cpu", MFD_CLOEXEC);
    if (fd < 0) abort();
    for (size_t done = 0; done < n;) {
        ssize_t wrote = write(fd, data + done, n - done);
        if (wrote <= 0) abort();
        done += (size_t)wrote;
    }
    return fd;
}

static size_t split(const uint8_t *data, size_t size, const uint8_t *parts[], size_t lens[]) {
    size_t count = 0, sep = sizeof SEPARATOR - 1;
    const uint8_t *at = data, *end = data + size;
    while (count < MAX_FILES) {
        const uint8_t *next = memmem(at, (size_t)(end - at), SEPARATOR, sep);
        parts[count] = at;
        lens[count++] = (size_t)((next ? next : end) - at);
        if (!next) break;
        at = next + sep;
    }
    return count;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1) return 0;
    int big = data[0] & 1;
    unsigned long long chunk = RECORD_MIN + 8ULL * (data[0] >> 1);
    const uint8_t *parts[MAX_FILES];
    size_t lens[MAX_FILES], n = split(data + 1, size - 1, parts, lens);

    PyObject *all = PyByteArray_FromStringAndSize("", 0), *paths = PyList_New(0),
             *cpus = PyList_New(0), *nodes = PyList_New(0);
    int fds[MAX_FILES];
    if (!all || !paths || !cpus || !nodes) abort();
    for (size_t i = 0; i < n; i++) {
        scan_file(parts[i], lens[i], big, (unsigned)i, all);
        fds[i] = memfd_of(parts[i], lens[i]);
        PyObject *path = PyUnicode_FromFormat("/proc/self/fd/%d", fds[i]);
        PyObject *cpu = PyLong_FromSize_t(i), *node = PyLong_FromLong((long)(i % 3) - 1);
        PyList_Append(paths, path);
        PyList_Append(cpus, cpu);
        PyList_Append(nodes, node);
        Py_DECREF(path);
        Py_DECREF(cpu);
        Py_DECREF(node);
    }
    Py_ssize_t scanned = PyByteArray_GET_SIZE(all) / (Py_ssize_t)sizeof(rec_t);
    PyObject *call = Py_BuildValue("(OOK)", all, nodes, 4096ULL);
    long long decoded = check_records(report_records(NULL, call), (size_t)scanned * RECORD_MIN);
    Py_DECREF(call);

    call = Py_BuildValue("(OOOiKK)", paths, cpus, nodes, big, 4096ULL, chunk);
    long long passed = check_records(report_pass(NULL, call), size);
    Py_DECREF(call);
    if (show)
        fprintf(stderr, "walker records: scan %zd, report_records %lld, report_pass %lld\n",
                scanned, decoded, passed);
    for (size_t i = 0; i < n; i++) close(fds[i]);
    Py_DECREF(all);
    Py_DECREF(paths);
    Py_DECREF(cpus);
    Py_DECREF(nodes);
    return 0;
}
