/*
 * mtrace-live's ring copier: a thread of its own that empties a BPF ring
 * buffer into a larger buffer in user memory, without the interpreter lock.
 *
 * Why (docs/performance.md, section 1): a record costs the probed program
 * less in a ring that fits the CPU's cache (433 ns a hit in 1 MiB against
 * 469 in 8 MiB, for the same 88-byte record), but a small ring fills in a few
 * milliseconds at two million records a second, and the interpreter, which
 * decodes the records and feeds the outputs, pauses longer than that now and
 * then. The copier takes every record committed, every millisecond while
 * they come fast (copier_main), whatever the interpreter is doing; the
 * interpreter takes them from the copier's buffer, which has the room the
 * user asked for (--buffer-pages). The kernel's ring is 2 MiB
 * (tracer/loop/live.py): with both CPUs busy the copier was seen to wait up to
 * 5 ms for a CPU, longer than 1 MiB lasts.
 *
 * The kernel's ring (kernel/bpf/ringbuf.c): page 0 holds the consumer
 * position (read-write), page 1 the producer position, and the data pages
 * follow, mapped twice in a row so that a record that wraps around the end
 * is contiguous. A record is an 8-byte header (its length, with a busy bit
 * while the producer writes it and a discard bit) and its data, rounded up
 * to 8 bytes. The copier moves whole records, headers included, and stops
 * at the first busy one, so its buffer holds complete records only; the
 * consumer position moves past what was copied. When the buffer is full the
 * copier leaves the records in the ring: the ring fills and the kernel
 * counts what it drops, as it did without a copier.
 *
 * The buffer has one writer (a pull, under `lock`: the thread, or take()
 * when the buffer is empty, so that a final read gets everything) and one
 * reader (take(), with the interpreter lock): `head` and `tail` are
 * published with release stores and read with acquire loads. An eventfd
 * (`fd`) becomes readable when the copier has copied something since the
 * last take().
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define BUSY_BIT (1u << 31)
#define DISCARD_BIT (1u << 30)
#define HEADER_SIZE 8

typedef struct {
    PyObject_HEAD
    uint64_t *consumer_pos; /* the ring's page 0 */
    uint64_t *producer_pos; /* page 1 */
    const uint8_t *data;    /* the data pages, twice */
    size_t page, ring_size, producer_map;
    uint8_t *buffer;
    size_t size; /* a power of two */
    uint64_t head, tail;
    int fd, ring_fd, stop_fd;
    long interval_ns;
    pthread_t thread;
    pthread_mutex_t lock;
    int running, stop, signalled;
    pid_t owner;
    uint64_t copies, copied;
} Copier;

static size_t record_step(uint32_t length)
{
    return ((length & ~(BUSY_BIT | DISCARD_BIT)) + HEADER_SIZE + 7) & ~(size_t)7;
}

/* Moves the ring's complete records into the buffer, as many as fit; the
 * bytes moved. The caller holds `lock`. */
static size_t pull(Copier *c)
{
    uint64_t consumer = __atomic_load_n(c->consumer_pos, __ATOMIC_RELAXED);
    uint64_t producer = __atomic_load_n(c->producer_pos, __ATOMIC_ACQUIRE);
    uint64_t head = c->head;
    size_t space = c->size - (size_t)(head - __atomic_load_n(&c->tail, __ATOMIC_ACQUIRE));
    const uint8_t *start = c->data + (consumer & (c->ring_size - 1));
    size_t span = 0;
    while (consumer + span < producer) {
        uint32_t length = __atomic_load_n((const uint32_t *)(start + span), __ATOMIC_ACQUIRE);
        if (length & BUSY_BIT)
            break;
        size_t step = record_step(length);
        if (span + step > space || span + step > c->ring_size)
            break;
        span += step;
    }
    if (!span)
        return 0;
    size_t at = head & (c->size - 1), first = c->size - at;
    if (first >= span) {
        memcpy(c->buffer + at, start, span);
    } else {
        memcpy(c->buffer + at, start, first);
        memcpy(c->buffer, start + first, span - first);
    }
    __atomic_store_n(&c->head, head + span, __ATOMIC_RELEASE);
    __atomic_store_n(c->consumer_pos, consumer + span, __ATOMIC_RELEASE);
    c->copies++;
    c->copied += span;
    return span;
}

/* The thread. After each pull it sleeps: `interval_ns` while a pull takes
 * an eighth of the ring or more, else twice as long each time, up to four
 * times the interval (fewer wake-ups, each of which may preempt the traced
 * program when both CPUs are busy; 2 MiB still lasts the longest sleep plus
 * the longest wait for a CPU seen, at 2.4 M records a second). With the
 * ring empty it waits in poll(2) until the kernel wakes it, which the
 * kernel does at the first record committed after the consumer caught up,
 * or until close(); then it sleeps one interval more, so that what follows
 * the first record is copied with it. */
static void *copier_main(void *arg)
{
    Copier *c = arg;
    /* It must run soon though both CPUs may be busy (the traced program on
     * one, the interpreter on the other): a thread that only copies gets a
     * higher weight if the tracer may give it one. */
    setpriority(PRIO_PROCESS, (id_t)syscall(SYS_gettid), -10);
    long sleep_ns = c->interval_ns;
    while (!__atomic_load_n(&c->stop, __ATOMIC_ACQUIRE)) {
        pthread_mutex_lock(&c->lock);
        size_t moved = pull(c);
        pthread_mutex_unlock(&c->lock);
        if (moved && !__atomic_exchange_n(&c->signalled, 1, __ATOMIC_ACQ_REL)) {
            uint64_t one = 1;
            if (write(c->fd, &one, sizeof(one)) < 0 && errno != EAGAIN)
                break;
        }
        if (!moved) {
            struct pollfd wait[2] = {{c->ring_fd, POLLIN, 0}, {c->stop_fd, POLLIN, 0}};
            if (poll(wait, 2, -1) < 0 && errno != EINTR)
                break;
            sleep_ns = c->interval_ns;
        } else if (moved >= c->ring_size / 8) {
            sleep_ns = c->interval_ns;
        } else if (sleep_ns < 4 * c->interval_ns) {
            sleep_ns *= 2;
        }
        struct timespec pause = {sleep_ns / 1000000000L, sleep_ns % 1000000000L};
        nanosleep(&pause, NULL);
    }
    return NULL;
}

static void release(Copier *c)
{
    if (c->running && c->owner == getpid()) {
        __atomic_store_n(&c->stop, 1, __ATOMIC_RELEASE);
        uint64_t one = 1;
        ssize_t woken = write(c->stop_fd, &one, sizeof(one)); /* cannot fail: one write */
        (void)woken;
        Py_BEGIN_ALLOW_THREADS
        pthread_join(c->thread, NULL);
        Py_END_ALLOW_THREADS
    }
    c->running = 0;
    if (c->consumer_pos) {
        munmap(c->consumer_pos, c->page);
        c->consumer_pos = NULL;
    }
    if (c->producer_pos) {
        munmap(c->producer_pos, c->producer_map);
        c->producer_pos = NULL;
        c->data = NULL;
    }
    if (c->buffer) {
        munmap(c->buffer, c->size);
        c->buffer = NULL;
    }
    int *fds[] = {&c->fd, &c->ring_fd, &c->stop_fd};
    for (size_t i = 0; i < sizeof(fds) / sizeof(fds[0]); i++) {
        if (*fds[i] >= 0) {
            close(*fds[i]);
            *fds[i] = -1;
        }
    }
}

/* The kernel's ring mapped (its consumer page, then its producer page and
 * data twice over) and the copier's buffer, populated: 0, or -1 (errno). */
static int map_ring(Copier *c, int map_fd)
{
    void *consumer = mmap(NULL, c->page, PROT_READ | PROT_WRITE, MAP_SHARED, map_fd, 0);
    if (consumer == MAP_FAILED)
        return -1;
    c->consumer_pos = consumer;
    c->producer_map = c->page + 2 * c->ring_size;
    void *producer = mmap(NULL, c->producer_map, PROT_READ, MAP_SHARED, map_fd, (off_t)c->page);
    if (producer == MAP_FAILED)
        return -1;
    c->producer_pos = producer;
    c->data = (const uint8_t *)producer + c->page;
    /* Populated now, as the kernel's ring is: a page fault in the copier
     * waits for the mmap lock, which the interpreter's own mappings take. */
    void *buffer = mmap(NULL, c->size, PROT_READ | PROT_WRITE,
                        MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
    if (buffer == MAP_FAILED)
        return -1;
    c->buffer = buffer;
    return 0;
}

/* The copier's descriptors and lock made and its thread started: 0, or -1 (errno). */
static int start_copying(Copier *c, int map_fd)
{
    c->fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    c->stop_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    /* Its own descriptor of the map, to poll: the caller's may be closed first. */
    c->ring_fd = fcntl(map_fd, F_DUPFD_CLOEXEC, 0);
    if (c->fd < 0 || c->stop_fd < 0 || c->ring_fd < 0)
        return -1;
    if (pthread_mutex_init(&c->lock, NULL)) {
        errno = EAGAIN;
        return -1;
    }
    int err = pthread_create(&c->thread, NULL, copier_main, c);
    if (err) {
        errno = err;
        return -1;
    }
    return 0;
}

static int copier_init(Copier *c, PyObject *args, PyObject *kwds)
{
    static char *keywords[] = {"map_fd", "ring_size", "buffer_size", "interval_us", NULL};
    int map_fd;
    Py_ssize_t ring_size, buffer_size;
    long interval_us = 1000;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "inn|l", keywords, &map_fd, &ring_size,
                                     &buffer_size, &interval_us))
        return -1;
    long page = sysconf(_SC_PAGESIZE);
    if (ring_size <= 0 || ring_size & (ring_size - 1) || ring_size % page || buffer_size < ring_size ||
        buffer_size & (buffer_size - 1) || interval_us <= 0) {
        PyErr_SetString(PyExc_ValueError, "ring and buffer sizes must be powers of two, "
                                          "the buffer at least the ring, the interval positive");
        return -1;
    }
    if (c->running || c->consumer_pos) {
        PyErr_SetString(PyExc_RuntimeError, "a copier is initialised once");
        return -1;
    }
    c->page = (size_t)page;
    c->ring_size = (size_t)ring_size;
    c->size = (size_t)buffer_size;
    c->interval_ns = interval_us * 1000L;
    c->owner = getpid();
    if (map_ring(c, map_fd) || start_copying(c, map_fd))
        goto failed;
    c->running = 1;
    return 0;
failed:
    PyErr_SetFromErrno(PyExc_OSError);
    release(c);
    return -1;
}

/* take(limit=-1): the complete records copied so far, as bytes (headers
 * included), at most `limit` bytes of them but at least one record. */
static PyObject *copier_take(Copier *c, PyObject *args)
{
    Py_ssize_t limit = -1;
    if (!PyArg_ParseTuple(args, "|n", &limit))
        return NULL;
    if (!c->buffer) {
        PyErr_SetString(PyExc_ValueError, "the copier is closed");
        return NULL;
    }
    uint64_t cleared;
    if (read(c->fd, &cleared, sizeof(cleared)) < 0 && errno != EAGAIN)
        return PyErr_SetFromErrno(PyExc_OSError);
    __atomic_store_n(&c->signalled, 0, __ATOMIC_RELEASE);
    uint64_t tail = c->tail;
    if (__atomic_load_n(&c->head, __ATOMIC_ACQUIRE) == tail) {
        pthread_mutex_lock(&c->lock);
        pull(c);
        pthread_mutex_unlock(&c->lock);
    }
    size_t available = (size_t)(__atomic_load_n(&c->head, __ATOMIC_ACQUIRE) - tail);
    size_t mask = c->size - 1, n = available;
    if (limit >= 0 && available > (size_t)limit) {
        n = 0;
        while (n < available) {
            uint32_t length;
            memcpy(&length, c->buffer + ((tail + n) & mask), sizeof(length));
            size_t step = record_step(length);
            if (n && n + step > (size_t)limit)
                break;
            n += step;
        }
    }
    PyObject *out = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)n);
    if (!out)
        return NULL;
    char *to = PyBytes_AS_STRING(out);
    size_t at = tail & mask, first = c->size - at;
    if (first >= n) {
        memcpy(to, c->buffer + at, n);
    } else {
        memcpy(to, c->buffer + at, first);
        memcpy(to + first, c->buffer, n - first);
    }
    __atomic_store_n(&c->tail, tail + n, __ATOMIC_RELEASE);
    return out;
}

static PyObject *copier_close(Copier *c, PyObject *Py_UNUSED(ignored))
{
    release(c);
    Py_RETURN_NONE;
}

static PyObject *copier_get_fd(Copier *c, void *Py_UNUSED(closure)) { return PyLong_FromLong(c->fd); }

/* (pulls that moved records, bytes moved) */
static PyObject *copier_get_stats(Copier *c, void *Py_UNUSED(closure))
{
    return Py_BuildValue("(KK)", (unsigned long long)c->copies, (unsigned long long)c->copied);
}

static void copier_dealloc(Copier *c)
{
    release(c);
    Py_TYPE(c)->tp_free((PyObject *)c);
}

static PyObject *copier_new(PyTypeObject *type, PyObject *Py_UNUSED(args), PyObject *Py_UNUSED(kwds))
{
    Copier *c = (Copier *)type->tp_alloc(type, 0);
    if (c)
        c->fd = c->ring_fd = c->stop_fd = -1;
    return (PyObject *)c;
}

static PyMethodDef copier_methods[] = {
    {"take", (PyCFunction)copier_take, METH_VARARGS,
     "take(limit=-1): the complete records copied so far (headers included), as bytes"},
    {"close", (PyCFunction)copier_close, METH_NOARGS, "Stop the thread and unmap the ring."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef copier_getset[] = {
    {"fd", (getter)copier_get_fd, NULL, "readable when records were copied since the last take()",
     NULL},
    {"stats", (getter)copier_get_stats, NULL, "(pulls that moved records, bytes moved)", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject CopierType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "mtrace_live.tracer._ring_copy.Copier",
    .tp_basicsize = sizeof(Copier),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Copier(map_fd, ring_size, buffer_size, interval_us=1000): a thread that empties a "
              "BPF ring buffer into a buffer of buffer_size bytes",
    .tp_new = copier_new,
    .tp_init = (initproc)copier_init,
    .tp_dealloc = (destructor)copier_dealloc,
    .tp_methods = copier_methods,
    .tp_getset = copier_getset,
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_ring_copy", NULL, -1, NULL,
                                    NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__ring_copy(void)
{
    if (PyType_Ready(&CopierType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m)
        return NULL;
    /* the ring's layout, as above: tracer/bpf/ringbuf.py takes it from here */
    if (PyModule_AddIntConstant(m, "BUSY_BIT", BUSY_BIT) < 0 ||
        PyModule_AddIntConstant(m, "DISCARD_BIT", DISCARD_BIT) < 0 ||
        PyModule_AddIntConstant(m, "HEADER_SIZE", HEADER_SIZE) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    Py_INCREF(&CopierType);
    if (PyModule_AddObject(m, "Copier", (PyObject *)&CopierType) < 0) {
        Py_DECREF(&CopierType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
