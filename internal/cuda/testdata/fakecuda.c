/*
 * fakecuda.c: a fake libcuda.so.1 for testing package cuda without a GPU.
 *
 * It exports the driver API symbols package cuda binds, under the names a
 * real libcuda.so.1 exports, and gives them CUDA's semantics on host memory,
 * strictly enough to catch binding mistakes:
 *
 *  - Device memory is a POSIX shared memory object per allocation
 *    ("/fakecuda.<pid>.<n>", unlinked only by cuMemFree), mapped into the
 *    process; the CUdeviceptr is the mapping's address. cuIpcGetMemHandle
 *    writes a magic, the size, the pid and the object's name into the 64
 *    bytes, and cuIpcOpenMemHandle in another process maps the object.
 *    A Go program exits without running C destructors, so one that exits
 *    (or crashes) holding allocations leaves their objects behind: cuInit
 *    removes the objects of processes that no longer exist.
 *  - The current context is thread-local, as in CUDA. Calls that need one
 *    fail with CUDA_ERROR_INVALID_CONTEXT on a thread without one, and
 *    everything but cuDriverGetVersion and cuGetErrorName fails with
 *    CUDA_ERROR_NOT_INITIALIZED before a successful cuInit.
 *  - Streams are asynchronous: each has a worker thread running a FIFO of
 *    queued copies and event records.
 *  - Flags and handles are checked: a wrong stream/event/host-alloc flag, a
 *    stream of another context, a handle this library did not make, a copy
 *    outside an allocation all fail, so arguments passed in the wrong
 *    register or with the wrong width show up as errors.
 *
 * What real CUDA does, as found in its documentation and issue threads:
 *  - cuIpcOpenMemHandle on a handle exported by the same process fails with
 *    CUDA_ERROR_INVALID_CONTEXT ("invalid device context": openucx/ucx pull
 *    request #11603, cuIpcOpenMemHandle() in the exporting process).
 *  - Opening a handle the current context already has open is not an error
 *    in current CUDA: "If the memory handle has already been opened by the
 *    current context, the reference count on the handle is incremented by 1
 *    and the existing device pointer is returned" (driver API reference,
 *    cuIpcOpenMemHandle). Old drivers refused it (openucx/ucx issue #3192,
 *    2019: "Element already exists", i.e. CUDA_ERROR_ALREADY_MAPPED). This
 *    fake does what the current documentation says, and cuIpcCloseMemHandle
 *    unmaps at the last close.
 *  - cuIpcOpenMemHandle's Flags "must be specified as
 *    CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS"; cuMemAlloc of 0 bytes is
 *    CUDA_ERROR_INVALID_VALUE; cuMemGetAddressRange of an address in no
 *    allocation is CUDA_ERROR_NOT_FOUND (driver API reference).
 *  - cuMemcpyDtoHAsync into pageable memory (not from cuMemHostAlloc) is
 *    synchronous in real CUDA; here too.
 *  - Real CUDA may accept an interior pointer in cuIpcGetMemHandle; this fake
 *    insists on an allocation's base, as the documentation asks ("Base
 *    pointer to previously allocated device memory").
 *
 * Environment, read by cuInit:
 *   FAKECUDA_DEVICES        how many devices (default 1, at most 8); 0 makes
 *                           cuInit fail with CUDA_ERROR_NO_DEVICE.
 *   FAKECUDA_COPY_DELAY_US  every asynchronous copy sleeps this long before
 *                           copying (default 0).
 *   FAKECUDA_SETCURRENT_DELAY_US  cuCtxSetCurrent sleeps this long (default
 *                           0): long enough (tens of microseconds) and the Go
 *                           runtime hands the caller's P to another thread,
 *                           so that a goroutine not locked to its thread
 *                           comes back from the call on another one.
 *
 * Compile-time variants:
 *   -DFAKECUDA_LEGACY_NAMES      omit the _v2 names that have a same-signature
 *                                plain name (cuDevicePrimaryCtxRelease,
 *                                cuIpcOpenMemHandle, cuStreamDestroy,
 *                                cuEventDestroy), like a driver older than
 *                                CUDA 11 (or 4.0).
 *   -DFAKECUDA_OMIT_EVENT_QUERY  do not export cuEventQuery.
 *
 * fakecuda_* functions are for tests to look inside.
 *
 * cc -shared -fPIC -O2 -pthread -o libcuda.so.1 fakecuda.c
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <signal.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

#define API __attribute__((visibility("default")))

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef struct fctx *CUcontext;
typedef struct fstream *CUstream;
typedef struct fevent *CUevent;
typedef struct CUipcMemHandle_st {
	char reserved[64];
} CUipcMemHandle;

enum {
	CUDA_SUCCESS = 0,
	CUDA_ERROR_INVALID_VALUE = 1,
	CUDA_ERROR_OUT_OF_MEMORY = 2,
	CUDA_ERROR_NOT_INITIALIZED = 3,
	CUDA_ERROR_DEINITIALIZED = 4,
	CUDA_ERROR_NO_DEVICE = 100,
	CUDA_ERROR_INVALID_DEVICE = 101,
	CUDA_ERROR_INVALID_CONTEXT = 201,
	CUDA_ERROR_CONTEXT_ALREADY_CURRENT = 202,
	CUDA_ERROR_MAP_FAILED = 205,
	CUDA_ERROR_ALREADY_MAPPED = 208,
	CUDA_ERROR_INVALID_HANDLE = 400,
	CUDA_ERROR_NOT_FOUND = 500,
	CUDA_ERROR_NOT_READY = 600,
	CUDA_ERROR_ILLEGAL_ADDRESS = 700,
	CUDA_ERROR_NOT_PERMITTED = 800,
	CUDA_ERROR_NOT_SUPPORTED = 801,
	CUDA_ERROR_UNKNOWN = 999,
};

#define MAX_DEVICES 8
#define DEVICE_BASE 0x100 /* CUdevice = DEVICE_BASE + ordinal, so an ordinal passed as a CUdevice fails */
#define FAKE_VERSION 12080
#define CTX_MAGIC 0xC7C7C7C7u
static const char handle_magic[8] = {'F', 'A', 'K', 'E', 'C', 'U', 'D', 'A'};

/* Handle layout (64 bytes). */
struct ipc_layout {
	char magic[8];      /*  0: "FAKECUDA" */
	uint64_t size;      /*  8: allocation size */
	uint32_t pid;       /* 16: exporting process */
	int32_t device;     /* 20: exporting device ordinal */
	uint32_t serial;    /* 24: allocation number in that process */
	char name[36];      /* 28: shared memory object, NUL-padded */
};
_Static_assert(sizeof(struct ipc_layout) == 64, "handle layout");

struct fctx {
	unsigned magic;
	int ordinal;
	int refs;           /* primary context retains; 0 = inactive */
	long pending;       /* queued, unfinished stream ops */
};

enum mkind { MEM_ALLOC, MEM_IPC, MEM_HOST };

struct mem {
	struct mem *next;
	enum mkind kind;
	char *base;
	size_t size;
	int refs;           /* MEM_IPC: opens */
	unsigned flags;     /* MEM_HOST: cuMemHostAlloc flags */
	uint32_t serial;    /* MEM_ALLOC */
	char name[36];      /* MEM_ALLOC, MEM_IPC: shm object */
};

enum okind { OP_COPY, OP_EVENT };

struct op {
	struct op *next;
	enum okind kind;
	void *dst;
	const void *src;
	size_t n;
	struct fevent *ev;
	unsigned long long gen;
};

struct fstream {
	struct fstream *next;
	struct fctx *ctx;
	unsigned flags;
	pthread_t thr;
	pthread_cond_t work;
	struct op *head, *tail;
	struct op *cur;     /* the copy the worker is doing (mu dropped) */
	int stop;
	unsigned long long enq, done;
};

struct fevent {
	struct fevent *next;
	struct fctx *ctx;
	unsigned flags;
	unsigned long long recorded, completed;
	int refs;           /* the registry's and each queued record's */
};

/* One lock guards everything; workers drop it while copying. */
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t done_cond = PTHREAD_COND_INITIALIZER;

static int initialized;
static int ndevices;
static long copy_delay_us;
static long setcurrent_delay_us;
static struct fctx ctxs[MAX_DEVICES];
static struct mem *mems;
static struct fstream *streams;
static struct fevent *events;
static long pending_total;
static uint32_t serials;
static long legacy_calls;
static unsigned char last_handle[64];
static unsigned last_flags;

static __thread struct fctx *current;

/* ---- helpers (mu held where noted) ---- */

static CUresult need_init(void)
{
	return __atomic_load_n(&initialized, __ATOMIC_ACQUIRE) ? CUDA_SUCCESS : CUDA_ERROR_NOT_INITIALIZED;
}

/* need_ctx: initialized, and this thread has a live current context. */
static CUresult need_ctx(void)
{
	CUresult rc = need_init();
	if (rc != CUDA_SUCCESS)
		return rc;
	if (current == NULL)
		return CUDA_ERROR_INVALID_CONTEXT;
	pthread_mutex_lock(&mu);
	int live = current->refs > 0;
	pthread_mutex_unlock(&mu);
	return live ? CUDA_SUCCESS : CUDA_ERROR_INVALID_CONTEXT;
}

static struct fctx *ctx_of(CUcontext c)
{
	for (int i = 0; i < ndevices; i++)
		if (c == &ctxs[i])
			return c;
	return NULL;
}

static int device_ordinal(CUdevice d)
{
	int o = d - DEVICE_BASE;
	return o >= 0 && o < ndevices ? o : -1;
}

/* mu held */
static struct mem *find_base(enum mkind kind, const void *p)
{
	for (struct mem *m = mems; m; m = m->next)
		if (m->kind == kind && m->base == p)
			return m;
	return NULL;
}

/* mu held: the device allocation or IPC mapping holding [p, p+n). */
static struct mem *find_dev_range(uintptr_t p, size_t n)
{
	for (struct mem *m = mems; m; m = m->next) {
		if (m->kind == MEM_HOST)
			continue;
		uintptr_t b = (uintptr_t)m->base;
		if (p >= b && p - b < m->size && n <= m->size - (p - b))
			return m;
	}
	return NULL;
}

/* mu held */
static struct mem *find_host_range(uintptr_t p, size_t n)
{
	for (struct mem *m = mems; m; m = m->next) {
		if (m->kind != MEM_HOST)
			continue;
		uintptr_t b = (uintptr_t)m->base;
		if (p >= b && p - b < m->size && n <= m->size - (p - b))
			return m;
	}
	return NULL;
}

static void unlink_mem(struct mem *m)
{
	for (struct mem **pp = &mems; *pp; pp = &(*pp)->next)
		if (*pp == m) {
			*pp = m->next;
			return;
		}
}

/* touches reports whether [p, p+n) overlaps m's mapping. */
static int touches(const struct mem *m, const void *p, size_t n)
{
	const char *c = p;
	return c < m->base + m->size && c + n > m->base;
}

/* uses reports whether copy o reads or writes m's mapping. */
static int uses(const struct mem *m, const struct op *o)
{
	return o->kind == OP_COPY && (touches(m, o->dst, o->n) || touches(m, o->src, o->n));
}

/* mu held: wait until no stream work is queued anywhere (the implicit
 * synchronisation of cuMemFree and friends). */
static void wait_idle(void)
{
	while (pending_total > 0)
		pthread_cond_wait(&done_cond, &mu);
}

/* mu held */
static struct fstream *find_stream(CUstream s)
{
	for (struct fstream *x = streams; x; x = x->next)
		if (x == s)
			return x;
	return NULL;
}

/* mu held */
static struct fevent *find_event(CUevent e)
{
	for (struct fevent *x = events; x; x = x->next)
		if (x == e)
			return x;
	return NULL;
}

/* mu held */
static void event_unref(struct fevent *e)
{
	if (--e->refs == 0)
		free(e);
}

static void *worker(void *arg)
{
	struct fstream *s = arg;
	pthread_mutex_lock(&mu);
	for (;;) {
		while (s->head == NULL && !s->stop)
			pthread_cond_wait(&s->work, &mu);
		if (s->head == NULL)
			break;
		struct op *o = s->head;
		s->head = o->next;
		if (s->head == NULL)
			s->tail = NULL;
		if (o->kind == OP_COPY) {
			long delay = copy_delay_us;
			s->cur = o;
			pthread_mutex_unlock(&mu);
			if (delay > 0)
				usleep((useconds_t)delay);
			memcpy(o->dst, o->src, o->n);
			pthread_mutex_lock(&mu);
			s->cur = NULL;
		} else {
			if (o->ev->completed < o->gen)
				o->ev->completed = o->gen;
			event_unref(o->ev);
		}
		s->done++;
		s->ctx->pending--;
		pending_total--;
		pthread_cond_broadcast(&done_cond);
		free(o);
	}
	pthread_mutex_unlock(&mu);
	return NULL;
}

/* mu held */
static void enqueue(struct fstream *s, struct op *o)
{
	o->next = NULL;
	if (s->tail)
		s->tail->next = o;
	else
		s->head = o;
	s->tail = o;
	s->enq++;
	s->ctx->pending++;
	pending_total++;
	pthread_cond_signal(&s->work);
}

/* A stream argument: 0 is the legacy default stream (synchronous here);
 * anything else must be a live stream of the current context. mu held. */
static CUresult stream_arg(CUstream h, struct fstream **out)
{
	*out = NULL;
	if (h == NULL)
		return CUDA_SUCCESS;
	struct fstream *s = find_stream(h);
	if (s == NULL || s->ctx != current)
		return CUDA_ERROR_INVALID_HANDLE;
	*out = s;
	return CUDA_SUCCESS;
}

/* Remove the shared memory objects this process still owns at exit. */
__attribute__((destructor)) static void cleanup(void)
{
	for (struct mem *m = mems; m; m = m->next)
		if (m->kind == MEM_ALLOC)
			shm_unlink(m->name);
}

/* Remove "/fakecuda.<pid>.<n>" objects whose process is gone (ESRCH; a
 * process we may not signal is alive). */
static void sweep_dead(void)
{
	DIR *d = opendir("/dev/shm");
	if (d == NULL)
		return;
	struct dirent *e;
	while ((e = readdir(d)) != NULL) {
		int pid;
		unsigned n;
		char extra;
		if (sscanf(e->d_name, "fakecuda.%d.%u%c", &pid, &n, &extra) != 2 || pid <= 0 || pid == (int)getpid())
			continue;
		if (kill((pid_t)pid, 0) == 0 || errno != ESRCH)
			continue;
		char name[300];
		snprintf(name, sizeof name, "/%s", e->d_name);
		shm_unlink(name);
	}
	closedir(d);
}

/* ---- initialisation, version, errors ---- */

API CUresult cuInit(unsigned int flags)
{
	if (flags != 0)
		return CUDA_ERROR_INVALID_VALUE;
	pthread_mutex_lock(&mu);
	if (initialized) {
		pthread_mutex_unlock(&mu);
		return CUDA_SUCCESS;
	}
	const char *e = getenv("FAKECUDA_DEVICES");
	int n = e && *e ? atoi(e) : 1;
	if (n <= 0) {
		pthread_mutex_unlock(&mu);
		return CUDA_ERROR_NO_DEVICE;
	}
	if (n > MAX_DEVICES)
		n = MAX_DEVICES;
	e = getenv("FAKECUDA_COPY_DELAY_US");
	copy_delay_us = e && *e ? atol(e) : 0;
	e = getenv("FAKECUDA_SETCURRENT_DELAY_US");
	setcurrent_delay_us = e && *e ? atol(e) : 0;
	sweep_dead();
	ndevices = n;
	for (int i = 0; i < n; i++)
		ctxs[i] = (struct fctx){.magic = CTX_MAGIC, .ordinal = i};
	__atomic_store_n(&initialized, 1, __ATOMIC_RELEASE);
	pthread_mutex_unlock(&mu);
	return CUDA_SUCCESS;
}

API CUresult cuDriverGetVersion(int *v)
{
	if (v == NULL)
		return CUDA_ERROR_INVALID_VALUE;
	*v = FAKE_VERSION;
	return CUDA_SUCCESS;
}

static const struct {
	int code;
	const char *name;
} names[] = {
	{CUDA_SUCCESS, "CUDA_SUCCESS"},
	{CUDA_ERROR_INVALID_VALUE, "CUDA_ERROR_INVALID_VALUE"},
	{CUDA_ERROR_OUT_OF_MEMORY, "CUDA_ERROR_OUT_OF_MEMORY"},
	{CUDA_ERROR_NOT_INITIALIZED, "CUDA_ERROR_NOT_INITIALIZED"},
	{CUDA_ERROR_DEINITIALIZED, "CUDA_ERROR_DEINITIALIZED"},
	{CUDA_ERROR_NO_DEVICE, "CUDA_ERROR_NO_DEVICE"},
	{CUDA_ERROR_INVALID_DEVICE, "CUDA_ERROR_INVALID_DEVICE"},
	{CUDA_ERROR_INVALID_CONTEXT, "CUDA_ERROR_INVALID_CONTEXT"},
	{CUDA_ERROR_CONTEXT_ALREADY_CURRENT, "CUDA_ERROR_CONTEXT_ALREADY_CURRENT"},
	{CUDA_ERROR_MAP_FAILED, "CUDA_ERROR_MAP_FAILED"},
	{CUDA_ERROR_ALREADY_MAPPED, "CUDA_ERROR_ALREADY_MAPPED"},
	{CUDA_ERROR_INVALID_HANDLE, "CUDA_ERROR_INVALID_HANDLE"},
	{CUDA_ERROR_NOT_FOUND, "CUDA_ERROR_NOT_FOUND"},
	{CUDA_ERROR_NOT_READY, "CUDA_ERROR_NOT_READY"},
	{CUDA_ERROR_ILLEGAL_ADDRESS, "CUDA_ERROR_ILLEGAL_ADDRESS"},
	{CUDA_ERROR_NOT_PERMITTED, "CUDA_ERROR_NOT_PERMITTED"},
	{CUDA_ERROR_NOT_SUPPORTED, "CUDA_ERROR_NOT_SUPPORTED"},
	{CUDA_ERROR_UNKNOWN, "CUDA_ERROR_UNKNOWN"},
};

/* Like CUDA: works before cuInit; an unknown code sets *pStr to NULL and
 * returns CUDA_ERROR_INVALID_VALUE. */
API CUresult cuGetErrorName(CUresult code, const char **pStr)
{
	if (pStr == NULL)
		return CUDA_ERROR_INVALID_VALUE;
	for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
		if (names[i].code == code) {
			*pStr = names[i].name;
			return CUDA_SUCCESS;
		}
	*pStr = NULL;
	return CUDA_ERROR_INVALID_VALUE;
}

/* ---- devices and contexts ---- */

API CUresult cuDeviceGetCount(int *count)
{
	CUresult rc = need_init();
	if (rc != CUDA_SUCCESS)
		return rc;
	if (count == NULL)
		return CUDA_ERROR_INVALID_VALUE;
	*count = ndevices;
	return CUDA_SUCCESS;
}

API CUresult cuDeviceGet(CUdevice *device, int ordinal)
{
	CUresult rc = need_init();
	if (rc != CUDA_SUCCESS)
		return rc;
	if (device == NULL)
		return CUDA_ERROR_INVALID_VALUE;
	if (ordinal < 0 || ordinal >= ndevices)
		return CUDA_ERROR_INVALID_DEVICE;
	*device = DEVICE_BASE + ordinal;
	return CUDA_SUCCESS;
}

API CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev)
{
	CUresult rc = need_init();
	if (rc != CUDA_SUCCESS)
		return rc;
	if (pctx == NULL)
		return CUDA_ERROR_INVALID_VALUE;
	int o = device_ordinal(dev);
	if (o < 0)
		return CUDA_ERROR_INVALID_DEVICE;
	pthread_mutex_lock(&mu);
	ctxs[o].refs++;
	pthread_mutex_unlock(&mu);
	*pctx = &ctxs[o];
	return CUDA_SUCCESS;
}

static CUresult primary_release(CUdevice dev)
{
	CUresult rc = need_init();
	if (rc != CUDA_SUCCESS)
		return rc;
	int o = device_ordinal(dev);
	if (o < 0)
		return CUDA_ERROR_INVALID_DEVICE;
	pthread_mutex_lock(&mu);
	if (ctxs[o].refs == 0) {
		pthread_mutex_unlock(&mu);
		return CUDA_ERROR_INVALID_CONTEXT;
	}
	ctxs[o].refs--;
	pthread_mutex_unlock(&mu);
	return CUDA_SUCCESS;
}

#ifndef FAKECUDA_LEGACY_NAMES
API CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev)
{
	return primary_release(dev);
}
#endif

API CUresult cuDevicePrimaryCtxRelease(CUdevice dev)
{
	__atomic_add_fetch(&legacy_calls, 1, __ATOMIC_RELAXED);
	return primary_release(dev);
}

/* cuCtxGetCurrent: the calling thread's current context (NULL when none);
 * integrations/sglang/encgate_agent.py's stage_cuda asks for it. */
API CUresult cuCtxGetCurrent(CUcontext *pctx)
{
	CUresult rc = need_init();
	if (rc != CUDA_SUCCESS)
		return rc;
	if (pctx == NULL)
		return CUDA_ERROR_INVALID_VALUE;
	*pctx = (CUcontext)current;
	return CUDA_SUCCESS;
}

API CUresult cuCtxSetCurrent(CUcontext ctx)
{
	CUresult rc = need_init();
	if (rc != CUDA_SUCCESS)
		return rc;
	if (ctx != NULL && ctx_of(ctx) == NULL)
		return CUDA_ERROR_INVALID_CONTEXT;
	if (setcurrent_delay_us > 0)
		usleep((useconds_t)setcurrent_delay_us);
	current = ctx;
	return CUDA_SUCCESS;
}

API CUresult cuCtxSynchronize(void)
{
	CUresult rc = need_ctx();
	if (rc != CUDA_SUCCESS)
		return rc;
	pthread_mutex_lock(&mu);
	while (current->pending > 0)
		pthread_cond_wait(&done_cond, &mu);
	pthread_mutex_unlock(&mu);
	return CUDA_SUCCESS;
}

/* ---- device memory ---- */

API CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize)
{
	CUresult rc = need_ctx();
	if (rc != CUDA_SUCCESS)
		return rc;
	if (dptr == NULL || bytesize == 0)
		return CUDA_ERROR_INVALID_VALUE;
	struct mem *m = calloc(1, sizeof *m);
	if (m == NULL)
		return CUDA_ERROR_OUT_OF_MEMORY;
	m->kind = MEM_ALLOC;
	m->size = bytesize;
	m->serial = __atomic_add_fetch(&serials, 1, __ATOMIC_RELAXED);
	snprintf(m->name, sizeof m->name, "/fakecuda.%d.%u", (int)getpid(), m->serial);
	int fd = shm_open(m->name, O_RDWR | O_CREAT | O_EXCL, 0600);
	if (fd < 0) {
		free(m);
		return CUDA_ERROR_OUT_OF_MEMORY;
	}
	void *p = MAP_FAILED;
	if (ftruncate(fd, (off_t)bytesize) == 0)
		p = mmap(NULL, bytesize, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	close(fd);
	if (p == MAP_FAILED) {
		shm_unlink(m->name);
		free(m);
		return CUDA_ERROR_OUT_OF_MEMORY;
	}
	m->base = p;
	pthread_mutex_lock(&mu);
	m->next = mems;
	mems = m;
	pthread_mutex_unlock(&mu);
	*dptr = (CUdeviceptr)(uintptr_t)p;
	return CUDA_SUCCESS;
}

API CUresult cuMemFree_v2(CUdeviceptr dptr)
{
	CUresult rc = need_ctx();
	if (rc != CUDA_SUCCESS)
		return rc;
	pthread_mutex_lock(&mu);
	struct mem *m = find_base(MEM_ALLOC, (void *)(uintptr_t)dptr);
	if (m == NULL) {
		pthread_mutex_unlock(&mu);
		return CUDA_ERROR_INVALID_VALUE;
	}
	wait_idle();
	unlink_mem(m);
	pthread_mutex_unlock(&mu);
	munmap(m->base, m->size);
	shm_unlink(m->name);
	free(m);
	return CUDA_SUCCESS;
}

API CUresult cuMemGetAddressRange_v2(CUdeviceptr *pbase, size_t *psize, CUdeviceptr dptr)
{
	CUresult rc = need_ctx();
	if (rc != CUDA_SUCCESS)
		return rc;
	pthread_mutex_lock(&mu);
	struct mem *m = find_dev_range((uintptr_t)dptr, 1);
	if (m == NULL) {
		pthread_mutex_unlock(&mu);
		return CUDA_ERROR_NOT_FOUND;
	}
	if (pbase)
		*pbase = (CUdeviceptr)(uintptr_t)m->base;
	if (psize)
		*psize = m->size;
	pthread_mutex_unlock(&mu);
	return CUDA_SUCCESS;
}

/* ---- pinned host memory ---- */

#define HOSTALLOC_FLAGS 0x7 /* PORTABLE | DEVICEMAP | WRITECOMBINED */

API CUresult cuMemHostAlloc(void **pp, size_t bytesize, unsigned int flags)
{
	CUresult rc = need_ctx();
	if (rc != CUDA_SUCCESS)
		return rc;
	if (pp == NULL || bytesize == 0 || (flags & ~HOSTALLOC_FLAGS) != 0)
		return CUDA_ERROR_INVALID_VALUE;
	void *p = mmap(NULL, bytesize, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	if (p == MAP_FAILED)
		return CUDA_ERROR_OUT_OF_MEMORY;
	struct mem *m = calloc(1, sizeof *m);
	if (m == NULL) {
		munmap(p, bytesize);
		return CUDA_ERROR_OUT_OF_MEMORY;
	}
	m->kind = MEM_HOST;
	m->base = p;
	m->size = bytesize;
	m->flags = flags;
	pthread_mutex_lock(&mu);
	m->next = mems;
	mems = m;
	pthread_mutex_unlock(&mu);
	*pp = p;
	return CUDA_SUCCESS;
}

API CUresult cuMemFreeHost(void *p)
{
	CUresult rc = need_ctx();
	if (rc != CUDA_SUCCESS)
		return rc;
	pthread_mutex_lock(&mu);
	struct mem *m = find_base(MEM_HOST, p);
	if (m == NULL) {
		pthread_mutex_unlock(&mu);
		return CUDA_ERROR_INVALID_VALUE;
	}
	wait_idle();
	unlink_mem(m);
	pthread_mutex_unlock(&mu);
	munmap(m->base, m->size);
	free(m);
	return CUDA_SUCCESS;
}

/* ---- IPC ---- */

API CUresult cuIpcGetMemHandle(CUipcMemHandle *pHandle, CUdeviceptr dptr)
{
	CUresult rc = need_ctx();
	if (rc != CUDA_SUCCESS)
		return rc;
	if (pHandle == NULL)
		return CUDA_ERROR_INVALID_VALUE;
	pthread_mutex_lock(&mu);
	struct mem *m = find_base(MEM_ALLOC, (void *)(uintptr_t)dptr);
	if (m == NULL) {
		pthread_mutex_unlock(&mu);
		return CUDA_ERROR_INVALID_VALUE;
	}
	struct ipc_layout h;
	memset(&h, 0, sizeof h);
	memcpy(h.magic, handle_magic, sizeof h.magic);
	h.size = m->size;
	h.pid = (uint32_t)getpid();
	h.device = current->ordinal;
	h.serial = m->serial;
	memcpy(h.name, m->name, sizeof h.name);
	pthread_mutex_unlock(&mu);
	memcpy(pHandle, &h, sizeof h);
	return CUDA_SUCCESS;
}

static CUresult ipc_open(CUdeviceptr *pdptr, CUipcMemHandle handle, unsigned int flags)
{
	/* Record what arrived before judging it, for tests of the by-value
	 * passing. */
	pthread_mutex_lock(&mu);
	memcpy(last_handle, handle.reserved, sizeof last_handle);
	last_flags = flags;
	pthread_mutex_unlock(&mu);

	CUresult rc = need_ctx();
	if (rc != CUDA_SUCCESS)
		return rc;
	if (pdptr == NULL || flags != 1 /* CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS */)
		return CUDA_ERROR_INVALID_VALUE;
	struct ipc_layout h;
	memcpy(&h, handle.reserved, sizeof h);
	if (memcmp(h.magic, handle_magic, sizeof h.magic) != 0 || h.size == 0 ||
	    memchr(h.name, 0, sizeof h.name) == NULL || strncmp(h.name, "/fakecuda.", 10) != 0)
		return CUDA_ERROR_INVALID_VALUE;
	if (h.pid == (uint32_t)getpid())
		return CUDA_ERROR_INVALID_CONTEXT;

	pthread_mutex_lock(&mu);
	for (struct mem *m = mems; m; m = m->next)
		if (m->kind == MEM_IPC && strcmp(m->name, h.name) == 0) {
			m->refs++;
			*pdptr = (CUdeviceptr)(uintptr_t)m->base;
			pthread_mutex_unlock(&mu);
			return CUDA_SUCCESS;
		}
	pthread_mutex_unlock(&mu);

	int fd = shm_open(h.name, O_RDWR, 0);
	if (fd < 0)
		return CUDA_ERROR_INVALID_HANDLE; /* freed, or its process is gone */
	struct stat st;
	if (fstat(fd, &st) != 0 || (uint64_t)st.st_size != h.size) {
		close(fd);
		return CUDA_ERROR_INVALID_HANDLE;
	}
	void *p = mmap(NULL, h.size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	close(fd);
	if (p == MAP_FAILED)
		return CUDA_ERROR_MAP_FAILED;
	struct mem *m = calloc(1, sizeof *m);
	if (m == NULL) {
		munmap(p, h.size);
		return CUDA_ERROR_OUT_OF_MEMORY;
	}
	m->kind = MEM_IPC;
	m->base = p;
	m->size = h.size;
	m->refs = 1;
	memcpy(m->name, h.name, sizeof m->name);
	pthread_mutex_lock(&mu);
	m->next = mems;
	mems = m;
	pthread_mutex_unlock(&mu);
	*pdptr = (CUdeviceptr)(uintptr_t)p;
	return CUDA_SUCCESS;
}

#ifndef FAKECUDA_LEGACY_NAMES
API CUresult cuIpcOpenMemHandle_v2(CUdeviceptr *pdptr, CUipcMemHandle handle, unsigned int flags)
{
	return ipc_open(pdptr, handle, flags);
}
#endif

API CUresult cuIpcOpenMemHandle(CUdeviceptr *pdptr, CUipcMemHandle handle, unsigned int flags)
{
	__atomic_add_fetch(&legacy_calls, 1, __ATOMIC_RELAXED);
	return ipc_open(pdptr, handle, flags);
}

API CUresult cuIpcCloseMemHandle(CUdeviceptr dptr)
{
	CUresult rc = need_ctx();
	if (rc != CUDA_SUCCESS)
		return rc;
	pthread_mutex_lock(&mu);
	struct mem *m = find_base(MEM_IPC, (void *)(uintptr_t)dptr);
	if (m == NULL) {
		pthread_mutex_unlock(&mu);
		return CUDA_ERROR_INVALID_VALUE;
	}
	if (--m->refs > 0) {
		pthread_mutex_unlock(&mu);
		return CUDA_SUCCESS;
	}
	/* Closing a mapping that queued or running work still reads or writes
	 * is undefined in CUDA; here it is fatal, so a caller that forgot to
	 * synchronize fails its test instead of passing by luck. */
	for (struct fstream *x = streams; x; x = x->next) {
		int used = x->cur != NULL && uses(m, x->cur);
		for (struct op *o = x->head; o && !used; o = o->next)
			used = uses(m, o);
		if (used) {
			fprintf(stderr, "fakecuda: cuIpcCloseMemHandle of a mapping that a queued or running copy still uses (undefined in CUDA)\n");
			abort();
		}
	}
	wait_idle();
	unlink_mem(m);
	pthread_mutex_unlock(&mu);
	munmap(m->base, m->size);
	free(m);
	return CUDA_SUCCESS;
}

/* ---- copies ---- */

API CUresult cuMemcpyHtoD_v2(CUdeviceptr dst, const void *src, size_t n)
{
	CUresult rc = need_ctx();
	if (rc != CUDA_SUCCESS)
		return rc;
	if (src == NULL)
		return CUDA_ERROR_INVALID_VALUE;
	pthread_mutex_lock(&mu);
	int ok = find_dev_range((uintptr_t)dst, n) != NULL;
	pthread_mutex_unlock(&mu);
	if (!ok)
		return CUDA_ERROR_INVALID_VALUE;
	memcpy((void *)(uintptr_t)dst, src, n);
	return CUDA_SUCCESS;
}

API CUresult cuMemcpyDtoH_v2(void *dst, CUdeviceptr src, size_t n)
{
	CUresult rc = need_ctx();
	if (rc != CUDA_SUCCESS)
		return rc;
	if (dst == NULL)
		return CUDA_ERROR_INVALID_VALUE;
	pthread_mutex_lock(&mu);
	int ok = find_dev_range((uintptr_t)src, n) != NULL;
	pthread_mutex_unlock(&mu);
	if (!ok)
		return CUDA_ERROR_INVALID_VALUE;
	memcpy(dst, (const void *)(uintptr_t)src, n);
	return CUDA_SUCCESS;
}

/* mu held: queue a copy on s, or (legacy stream, or sync) copy now after s
 * drained. */
static CUresult copy_async(struct fstream *s, void *dst, const void *src, size_t n, int sync)
{
	if (s != NULL && !sync) {
		struct op *o = calloc(1, sizeof *o);
		if (o == NULL)
			return CUDA_ERROR_OUT_OF_MEMORY;
		o->kind = OP_COPY;
		o->dst = dst;
		o->src = src;
		o->n = n;
		enqueue(s, o);
		return CUDA_SUCCESS;
	}
	if (s != NULL)
		while (s->done < s->enq)
			pthread_cond_wait(&done_cond, &mu);
	memcpy(dst, src, n);
	return CUDA_SUCCESS;
}

API CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream hStream)
{
	CUresult rc = need_ctx();
	if (rc != CUDA_SUCCESS)
		return rc;
	pthread_mutex_lock(&mu);
	struct fstream *s;
	rc = stream_arg(hStream, &s);
	if (rc == CUDA_SUCCESS && (find_dev_range((uintptr_t)dst, n) == NULL || find_dev_range((uintptr_t)src, n) == NULL))
		rc = CUDA_ERROR_INVALID_VALUE;
	if (rc == CUDA_SUCCESS)
		rc = copy_async(s, (void *)(uintptr_t)dst, (const void *)(uintptr_t)src, n, 0);
	pthread_mutex_unlock(&mu);
	return rc;
}

API CUresult cuMemcpyDtoHAsync_v2(void *dst, CUdeviceptr src, size_t n, CUstream hStream)
{
	CUresult rc = need_ctx();
	if (rc != CUDA_SUCCESS)
		return rc;
	if (dst == NULL)
		return CUDA_ERROR_INVALID_VALUE;
	pthread_mutex_lock(&mu);
	struct fstream *s;
	rc = stream_arg(hStream, &s);
	if (rc == CUDA_SUCCESS && find_dev_range((uintptr_t)src, n) == NULL)
		rc = CUDA_ERROR_INVALID_VALUE;
	if (rc == CUDA_SUCCESS) {
		int pageable = find_host_range((uintptr_t)dst, n) == NULL;
		rc = copy_async(s, dst, (const void *)(uintptr_t)src, n, pageable);
	}
	pthread_mutex_unlock(&mu);
	return rc;
}

/* ---- streams ---- */

API CUresult cuStreamCreate(CUstream *phStream, unsigned int flags)
{
	CUresult rc = need_ctx();
	if (rc != CUDA_SUCCESS)
		return rc;
	if (phStream == NULL || (flags & ~1u) != 0) /* CU_STREAM_DEFAULT, CU_STREAM_NON_BLOCKING */
		return CUDA_ERROR_INVALID_VALUE;
	struct fstream *s = calloc(1, sizeof *s);
	if (s == NULL)
		return CUDA_ERROR_OUT_OF_MEMORY;
	s->ctx = current;
	s->flags = flags;
	pthread_cond_init(&s->work, NULL);
	if (pthread_create(&s->thr, NULL, worker, s) != 0) {
		pthread_cond_destroy(&s->work);
		free(s);
		return CUDA_ERROR_OUT_OF_MEMORY;
	}
	pthread_mutex_lock(&mu);
	s->next = streams;
	streams = s;
	pthread_mutex_unlock(&mu);
	*phStream = s;
	return CUDA_SUCCESS;
}

API CUresult cuStreamSynchronize(CUstream hStream)
{
	CUresult rc = need_ctx();
	if (rc != CUDA_SUCCESS)
		return rc;
	pthread_mutex_lock(&mu);
	struct fstream *s;
	rc = stream_arg(hStream, &s);
	if (rc == CUDA_SUCCESS && s != NULL)
		while (s->done < s->enq)
			pthread_cond_wait(&done_cond, &mu);
	pthread_mutex_unlock(&mu);
	return rc;
}

/* Work already queued completes (the worker drains its queue before it
 * stops); CUDA returns at once, this waits, which callers cannot tell. */
static CUresult stream_destroy(CUstream hStream)
{
	CUresult rc = need_ctx();
	if (rc != CUDA_SUCCESS)
		return rc;
	pthread_mutex_lock(&mu);
	struct fstream *s;
	rc = stream_arg(hStream, &s);
	if (rc == CUDA_SUCCESS && s == NULL)
		rc = CUDA_ERROR_INVALID_HANDLE;
	if (rc != CUDA_SUCCESS) {
		pthread_mutex_unlock(&mu);
		return rc;
	}
	for (struct fstream **pp = &streams; *pp; pp = &(*pp)->next)
		if (*pp == s) {
			*pp = s->next;
			break;
		}
	s->stop = 1;
	pthread_cond_signal(&s->work);
	pthread_mutex_unlock(&mu);
	pthread_join(s->thr, NULL);
	pthread_cond_destroy(&s->work);
	free(s);
	return CUDA_SUCCESS;
}

#ifndef FAKECUDA_LEGACY_NAMES
API CUresult cuStreamDestroy_v2(CUstream hStream)
{
	return stream_destroy(hStream);
}
#endif

API CUresult cuStreamDestroy(CUstream hStream)
{
	__atomic_add_fetch(&legacy_calls, 1, __ATOMIC_RELAXED);
	return stream_destroy(hStream);
}

/* ---- events ---- */

#define EVENT_FLAGS 0xF /* BLOCKING_SYNC | DISABLE_TIMING | INTERPROCESS | ... */

API CUresult cuEventCreate(CUevent *phEvent, unsigned int flags)
{
	CUresult rc = need_ctx();
	if (rc != CUDA_SUCCESS)
		return rc;
	if (phEvent == NULL || (flags & ~EVENT_FLAGS) != 0)
		return CUDA_ERROR_INVALID_VALUE;
	struct fevent *e = calloc(1, sizeof *e);
	if (e == NULL)
		return CUDA_ERROR_OUT_OF_MEMORY;
	e->ctx = current;
	e->flags = flags;
	e->refs = 1;
	pthread_mutex_lock(&mu);
	e->next = events;
	events = e;
	pthread_mutex_unlock(&mu);
	*phEvent = e;
	return CUDA_SUCCESS;
}

API CUresult cuEventRecord(CUevent hEvent, CUstream hStream)
{
	CUresult rc = need_ctx();
	if (rc != CUDA_SUCCESS)
		return rc;
	pthread_mutex_lock(&mu);
	struct fevent *e = find_event(hEvent);
	struct fstream *s = NULL;
	if (e == NULL || e->ctx != current)
		rc = CUDA_ERROR_INVALID_HANDLE;
	else
		rc = stream_arg(hStream, &s);
	if (rc == CUDA_SUCCESS) {
		unsigned long long gen = ++e->recorded;
		if (s == NULL) {
			e->completed = gen;
		} else {
			struct op *o = calloc(1, sizeof *o);
			if (o == NULL) {
				rc = CUDA_ERROR_OUT_OF_MEMORY;
			} else {
				o->kind = OP_EVENT;
				o->ev = e;
				o->gen = gen;
				e->refs++;
				enqueue(s, o);
			}
		}
	}
	pthread_mutex_unlock(&mu);
	return rc;
}

#ifndef FAKECUDA_OMIT_EVENT_QUERY
API CUresult cuEventQuery(CUevent hEvent)
{
	CUresult rc = need_ctx();
	if (rc != CUDA_SUCCESS)
		return rc;
	pthread_mutex_lock(&mu);
	struct fevent *e = find_event(hEvent);
	if (e == NULL)
		rc = CUDA_ERROR_INVALID_HANDLE;
	else if (e->completed < e->recorded)
		rc = CUDA_ERROR_NOT_READY;
	pthread_mutex_unlock(&mu);
	return rc;
}
#endif

API CUresult cuEventSynchronize(CUevent hEvent)
{
	CUresult rc = need_ctx();
	if (rc != CUDA_SUCCESS)
		return rc;
	pthread_mutex_lock(&mu);
	struct fevent *e = find_event(hEvent);
	if (e == NULL) {
		rc = CUDA_ERROR_INVALID_HANDLE;
	} else {
		unsigned long long target = e->recorded;
		while (e->completed < target)
			pthread_cond_wait(&done_cond, &mu);
	}
	pthread_mutex_unlock(&mu);
	return rc;
}

static CUresult event_destroy(CUevent hEvent)
{
	CUresult rc = need_ctx();
	if (rc != CUDA_SUCCESS)
		return rc;
	pthread_mutex_lock(&mu);
	struct fevent *e = find_event(hEvent);
	if (e == NULL) {
		pthread_mutex_unlock(&mu);
		return CUDA_ERROR_INVALID_HANDLE;
	}
	for (struct fevent **pp = &events; *pp; pp = &(*pp)->next)
		if (*pp == e) {
			*pp = e->next;
			break;
		}
	event_unref(e); /* queued records keep it until they ran */
	pthread_mutex_unlock(&mu);
	return CUDA_SUCCESS;
}

#ifndef FAKECUDA_LEGACY_NAMES
API CUresult cuEventDestroy_v2(CUevent hEvent)
{
	return event_destroy(hEvent);
}
#endif

API CUresult cuEventDestroy(CUevent hEvent)
{
	__atomic_add_fetch(&legacy_calls, 1, __ATOMIC_RELAXED);
	return event_destroy(hEvent);
}

/* ---- for tests ---- */

/* The 64 bytes and the flags the last cuIpcOpenMemHandle received. */
API void fakecuda_last_ipc_open(unsigned char out[64], unsigned *flags)
{
	pthread_mutex_lock(&mu);
	memcpy(out, last_handle, sizeof last_handle);
	*flags = last_flags;
	pthread_mutex_unlock(&mu);
}

/* Calls of the plain (pre-_v2) names that have a _v2. */
API long fakecuda_legacy_calls(void)
{
	return __atomic_load_n(&legacy_calls, __ATOMIC_RELAXED);
}

/* The flags a stream, event or pinned allocation was created with; -1 if
 * there is no such thing. */
API int fakecuda_stream_flags(CUstream h)
{
	pthread_mutex_lock(&mu);
	struct fstream *s = find_stream(h);
	int f = s ? (int)s->flags : -1;
	pthread_mutex_unlock(&mu);
	return f;
}

API int fakecuda_event_flags(CUevent h)
{
	pthread_mutex_lock(&mu);
	struct fevent *e = find_event(h);
	int f = e ? (int)e->flags : -1;
	pthread_mutex_unlock(&mu);
	return f;
}

API int fakecuda_host_flags(void *p)
{
	pthread_mutex_lock(&mu);
	struct mem *m = find_base(MEM_HOST, p);
	int f = m ? (int)m->flags : -1;
	pthread_mutex_unlock(&mu);
	return f;
}

/* Live device allocations, IPC mappings and pinned buffers; primary context
 * retains of device ordinal. */
API int fakecuda_live(int kind)
{
	pthread_mutex_lock(&mu);
	int n = 0;
	for (struct mem *m = mems; m; m = m->next)
		if ((int)m->kind == kind)
			n++;
	pthread_mutex_unlock(&mu);
	return n;
}

API int fakecuda_ctx_refs(int ordinal)
{
	if (ordinal < 0 || ordinal >= MAX_DEVICES)
		return -1;
	pthread_mutex_lock(&mu);
	int n = ctxs[ordinal].refs;
	pthread_mutex_unlock(&mu);
	return n;
}
