/*
 * A stand-in libnvidia-ml.so.1 for the agent's tests: it answers the NVML calls
 * the agent makes (through the real nvidia-ml-py ctypes binding) from a
 * topology file named by $BERTH_FAKE_NVML_TOPOLOGY.
 *
 * The file is read again on every nvmlInitWithFlags, so a test can change the
 * host between two discoveries (a GPU that falls off the bus). Line format,
 * written by tests/agent/fake_nvml/__init__.py:
 *
 *   mode ok | mode driver-not-loaded
 *   driver <version> <cuda as 1000*major+10*minor>
 *   gpu <index> <minor> <memMiB> <migCapable> <migCurrent> <migPending> <lost> <uuid> <pciBusId> <name...>
 *   mig <gpuIndex> <slot> <gi> <ci> <memMiB> <uuid> <name...>
 *   event <gpuIndex> <eventType> <eventData> <gi> <ci>      (4294967295: no id)
 *   power <gpuIndex> <defaultLimitMw> <limitMw>               (none: power limits not supported)
 *   epoch <n>
 *
 * The calls that reset a GPU's settings (clocks, the power limit) are written,
 * one line each, to the file named by $BERTH_FAKE_NVML_CALLS, so a test sees
 * what the agent did: `reset-applications-clocks <gpu>`, `power-limit <gpu> <mw>`.
 *
 * Events are handed out once each, in file order, across re-reads of the
 * same epoch; a file with a new epoch starts its queue from the top.
 * Struct layouts follow nvml.h (nvmlPciInfo_t v3, nvmlMemory_t, nvmlEventData_t).
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

typedef int nvmlReturn_t;
enum {
    NVML_SUCCESS = 0,
    NVML_ERROR_UNINITIALIZED = 1,
    NVML_ERROR_INVALID_ARGUMENT = 2,
    NVML_ERROR_NOT_SUPPORTED = 3,
    NVML_ERROR_NOT_FOUND = 6,
    NVML_ERROR_INSUFFICIENT_SIZE = 7,
    NVML_ERROR_DRIVER_NOT_LOADED = 9,
    NVML_ERROR_TIMEOUT = 10,
    NVML_ERROR_GPU_IS_LOST = 15,
    NVML_ERROR_UNKNOWN = 999,
};

#define EV_SBE 0x1ULL
#define EV_DBE 0x2ULL
#define EV_PSTATE 0x4ULL
#define EV_XID 0x8ULL
#define EV_CLOCK 0x10ULL
#define EV_MIGCFG 0x100ULL
#define SUPPORTED_EVENTS (EV_SBE | EV_DBE | EV_PSTATE | EV_XID | EV_CLOCK | EV_MIGCFG)

#define MAX_GPUS 64
#define MAX_MIG 7
#define MAX_EVENTS 1024
#define NO_ID 0xFFFFFFFFu

typedef struct {
    char busIdLegacy[16];
    unsigned int domain;
    unsigned int bus;
    unsigned int device;
    unsigned int pciDeviceId;
    unsigned int pciSubSystemId;
    char busId[32];
} nvmlPciInfo_t;

typedef struct {
    unsigned long long total;
    unsigned long long free;
    unsigned long long used;
} nvmlMemory_t;

struct fake_dev {
    int kind; /* 1: a GPU, 2: a MIG device */
    int gpu;
    int slot;
    int present;
    unsigned int gi, ci;
    unsigned long long mem_mib;
    char uuid[96];
    char name[96];
};
typedef struct fake_dev *nvmlDevice_t;

typedef struct {
    nvmlDevice_t device;
    unsigned long long eventType;
    unsigned long long eventData;
    unsigned int gpuInstanceId;
    unsigned int computeInstanceId;
} nvmlEventData_t;

struct fake_gpu {
    struct fake_dev dev;
    unsigned int minor;
    int mig_capable, mig_current, mig_pending, lost;
    int power_supported;
    unsigned int power_default_mw, power_mw;
    char pci[32];
    struct fake_dev mig[MAX_MIG];
};

struct fake_event {
    int gpu;
    unsigned long long type, data;
    unsigned int gi, ci;
};

struct fake_set {
    unsigned long long mask[MAX_GPUS];
};
typedef struct fake_set *nvmlEventSet_t;

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static struct fake_gpu gpus[MAX_GPUS];
static int gpu_count;
static int refs;
static int driver_loaded;
static char driver_version[80];
static int cuda_version;
static struct fake_event events[MAX_EVENTS];
static int event_count;
static int events_delivered; /* survives re-reads of one epoch: each event is handed out once */
static unsigned long long epoch;

static void rest_of_line(char *dst, size_t size, const char *src) {
    while (*src == ' ') src++;
    snprintf(dst, size, "%s", src);
    dst[strcspn(dst, "\r\n")] = 0;
}

static void load_topology(void) {
    memset(gpus, 0, sizeof gpus);
    gpu_count = 0;
    event_count = 0;
    driver_loaded = 0;
    snprintf(driver_version, sizeof driver_version, "%s", "550.54.15");
    cuda_version = 12040;
    const char *path = getenv("BERTH_FAKE_NVML_TOPOLOGY");
    if (!path) return;
    FILE *f = fopen(path, "r");
    if (!f) return;
    driver_loaded = 1;
    char line[512];
    while (fgets(line, sizeof line, f)) {
        int n = 0;
        char word[64], uuid[96], pci[32];
        unsigned long long e;
        if (sscanf(line, "epoch %llu", &e) == 1) {
            if (e != epoch) events_delivered = 0;
            epoch = e;
        } else if (sscanf(line, "mode %63s", word) == 1) {
            driver_loaded = strcmp(word, "driver-not-loaded") != 0;
        } else if (sscanf(line, "driver %79s %d", driver_version, &cuda_version) == 2) {
        } else if (strncmp(line, "gpu ", 4) == 0) {
            int idx, cap, cur, pend, lost;
            unsigned int minor;
            unsigned long long mem;
            if (sscanf(line, "gpu %d %u %llu %d %d %d %d %95s %31s %n", &idx, &minor, &mem, &cap, &cur, &pend,
                       &lost, uuid, pci, &n) < 9 || idx < 0 || idx >= MAX_GPUS)
                continue;
            struct fake_gpu *g = &gpus[idx];
            g->dev.kind = 1;
            g->dev.gpu = idx;
            g->dev.present = 1;
            g->dev.mem_mib = mem;
            g->dev.gi = g->dev.ci = NO_ID;
            snprintf(g->dev.uuid, sizeof g->dev.uuid, "%s", uuid);
            rest_of_line(g->dev.name, sizeof g->dev.name, line + n);
            g->minor = minor;
            g->mig_capable = cap;
            g->mig_current = cur;
            g->mig_pending = pend;
            g->lost = lost;
            snprintf(g->pci, sizeof g->pci, "%s", pci);
            if (idx + 1 > gpu_count) gpu_count = idx + 1;
        } else if (strncmp(line, "mig ", 4) == 0) {
            int gpu, slot;
            unsigned int gi, ci;
            unsigned long long mem;
            if (sscanf(line, "mig %d %d %u %u %llu %95s %n", &gpu, &slot, &gi, &ci, &mem, uuid, &n) < 6 || gpu < 0 ||
                gpu >= MAX_GPUS || slot < 0 || slot >= MAX_MIG)
                continue;
            struct fake_dev *d = &gpus[gpu].mig[slot];
            d->kind = 2;
            d->gpu = gpu;
            d->slot = slot;
            d->present = 1;
            d->gi = gi;
            d->ci = ci;
            d->mem_mib = mem;
            snprintf(d->uuid, sizeof d->uuid, "%s", uuid);
            rest_of_line(d->name, sizeof d->name, line + n);
        } else if (strncmp(line, "power ", 6) == 0) {
            int gpu;
            unsigned int def, cur;
            if (sscanf(line, "power %d %u %u", &gpu, &def, &cur) == 3 && gpu >= 0 && gpu < MAX_GPUS) {
                gpus[gpu].power_supported = 1;
                gpus[gpu].power_default_mw = def;
                gpus[gpu].power_mw = cur;
            }
        } else if (strncmp(line, "event ", 6) == 0 && event_count < MAX_EVENTS) {
            struct fake_event *e = &events[event_count];
            if (sscanf(line, "event %d %llu %llu %u %u", &e->gpu, &e->type, &e->data, &e->gi, &e->ci) == 5 &&
                e->gpu >= 0 && e->gpu < MAX_GPUS)
                event_count++;
        }
    }
    fclose(f);
}

/* The GPU or MIG device behind a handle, or NULL for a handle this library never gave out. */
static struct fake_dev *device_of(nvmlDevice_t h) {
    for (int i = 0; i < gpu_count; i++) {
        if (h == &gpus[i].dev) return gpus[i].dev.present ? h : NULL;
        for (int s = 0; s < MAX_MIG; s++)
            if (h == &gpus[i].mig[s]) return gpus[i].mig[s].present ? h : NULL;
    }
    return NULL;
}

/* Common checks: initialized, a known handle, its GPU not lost. */
static nvmlReturn_t check(nvmlDevice_t h, struct fake_dev **out) {
    if (refs == 0) return NVML_ERROR_UNINITIALIZED;
    struct fake_dev *d = device_of(h);
    if (!d) return NVML_ERROR_INVALID_ARGUMENT;
    if (gpus[d->gpu].lost) return NVML_ERROR_GPU_IS_LOST;
    *out = d;
    return NVML_SUCCESS;
}

#define LOCKED(expr)                 \
    do {                             \
        pthread_mutex_lock(&lock);   \
        nvmlReturn_t r_ = (expr);    \
        pthread_mutex_unlock(&lock); \
        return r_;                   \
    } while (0)

static nvmlReturn_t copy_text(char *dst, unsigned int size, const char *src) {
    if (!dst) return NVML_ERROR_INVALID_ARGUMENT;
    if (strlen(src) + 1 > size) return NVML_ERROR_INSUFFICIENT_SIZE;
    memcpy(dst, src, strlen(src) + 1);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlInitWithFlags(unsigned int flags) {
    (void)flags;
    pthread_mutex_lock(&lock);
    load_topology();
    nvmlReturn_t r = NVML_SUCCESS;
    if (!driver_loaded)
        r = NVML_ERROR_DRIVER_NOT_LOADED;
    else
        refs++;
    pthread_mutex_unlock(&lock);
    return r;
}

nvmlReturn_t nvmlShutdown(void) {
    pthread_mutex_lock(&lock);
    nvmlReturn_t r = refs > 0 ? NVML_SUCCESS : NVML_ERROR_UNINITIALIZED;
    if (refs > 0) refs--;
    pthread_mutex_unlock(&lock);
    return r;
}

const char *nvmlErrorString(nvmlReturn_t result) {
    switch (result) {
    case NVML_SUCCESS: return "Success";
    case NVML_ERROR_UNINITIALIZED: return "Uninitialized";
    case NVML_ERROR_INVALID_ARGUMENT: return "Invalid Argument";
    case NVML_ERROR_NOT_SUPPORTED: return "Not Supported";
    case NVML_ERROR_NOT_FOUND: return "Not Found";
    case NVML_ERROR_INSUFFICIENT_SIZE: return "Insufficient Size";
    case NVML_ERROR_DRIVER_NOT_LOADED: return "Driver Not Loaded";
    case NVML_ERROR_TIMEOUT: return "Timeout";
    case NVML_ERROR_GPU_IS_LOST: return "GPU is lost";
    default: return "Unknown Error";
    }
}

static nvmlReturn_t driver_version_locked(char *version, unsigned int length) {
    if (refs == 0) return NVML_ERROR_UNINITIALIZED;
    return copy_text(version, length, driver_version);
}
nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length) {
    LOCKED(driver_version_locked(version, length));
}

static nvmlReturn_t cuda_locked(int *v) {
    if (refs == 0) return NVML_ERROR_UNINITIALIZED;
    if (!v) return NVML_ERROR_INVALID_ARGUMENT;
    *v = cuda_version;
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlSystemGetCudaDriverVersion(int *v) { LOCKED(cuda_locked(v)); }

static nvmlReturn_t count_locked(unsigned int *count) {
    if (refs == 0) return NVML_ERROR_UNINITIALIZED;
    if (!count) return NVML_ERROR_INVALID_ARGUMENT;
    *count = (unsigned int)gpu_count;
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *count) { LOCKED(count_locked(count)); }

static nvmlReturn_t handle_locked(unsigned int index, nvmlDevice_t *device) {
    if (refs == 0) return NVML_ERROR_UNINITIALIZED;
    if (!device || index >= (unsigned int)gpu_count || !gpus[index].dev.present) return NVML_ERROR_INVALID_ARGUMENT;
    *device = &gpus[index].dev;
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device) {
    LOCKED(handle_locked(index, device));
}

static nvmlReturn_t uuid_locked(nvmlDevice_t h, char *uuid, unsigned int length) {
    struct fake_dev *d;
    nvmlReturn_t r = check(h, &d);
    return r ? r : copy_text(uuid, length, d->uuid);
}
nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t h, char *uuid, unsigned int length) { LOCKED(uuid_locked(h, uuid, length)); }

static nvmlReturn_t name_locked(nvmlDevice_t h, char *name, unsigned int length) {
    struct fake_dev *d;
    nvmlReturn_t r = check(h, &d);
    return r ? r : copy_text(name, length, d->name);
}
nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t h, char *name, unsigned int length) { LOCKED(name_locked(h, name, length)); }

static nvmlReturn_t minor_locked(nvmlDevice_t h, unsigned int *minor) {
    struct fake_dev *d;
    nvmlReturn_t r = check(h, &d);
    if (r) return r;
    if (d->kind != 1) return NVML_ERROR_NOT_SUPPORTED;
    if (!minor) return NVML_ERROR_INVALID_ARGUMENT;
    *minor = gpus[d->gpu].minor;
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlDeviceGetMinorNumber(nvmlDevice_t h, unsigned int *minor) { LOCKED(minor_locked(h, minor)); }

static nvmlReturn_t pci_locked(nvmlDevice_t h, nvmlPciInfo_t *pci) {
    struct fake_dev *d;
    nvmlReturn_t r = check(h, &d);
    if (r) return r;
    if (!pci) return NVML_ERROR_INVALID_ARGUMENT;
    struct fake_gpu *g = &gpus[d->gpu];
    memset(pci, 0, sizeof *pci);
    snprintf(pci->busId, sizeof pci->busId, "%s", g->pci);
    snprintf(pci->busIdLegacy, sizeof pci->busIdLegacy, "%.15s", g->pci + (strlen(g->pci) > 12 ? 4 : 0));
    sscanf(g->pci, "%x:%x:%x", &pci->domain, &pci->bus, &pci->device);
    pci->pciDeviceId = 0x233010DE;
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlDeviceGetPciInfo_v3(nvmlDevice_t h, nvmlPciInfo_t *pci) { LOCKED(pci_locked(h, pci)); }

static nvmlReturn_t memory_locked(nvmlDevice_t h, nvmlMemory_t *mem) {
    struct fake_dev *d;
    nvmlReturn_t r = check(h, &d);
    if (r) return r;
    if (!mem) return NVML_ERROR_INVALID_ARGUMENT;
    mem->total = d->mem_mib * 1024ULL * 1024ULL;
    mem->used = 0;
    mem->free = mem->total;
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t h, nvmlMemory_t *mem) { LOCKED(memory_locked(h, mem)); }

static nvmlReturn_t mig_mode_locked(nvmlDevice_t h, unsigned int *current, unsigned int *pending) {
    struct fake_dev *d;
    nvmlReturn_t r = check(h, &d);
    if (r) return r;
    if (d->kind != 1 || !gpus[d->gpu].mig_capable) return NVML_ERROR_NOT_SUPPORTED;
    if (!current || !pending) return NVML_ERROR_INVALID_ARGUMENT;
    *current = (unsigned int)gpus[d->gpu].mig_current;
    *pending = (unsigned int)gpus[d->gpu].mig_pending;
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlDeviceGetMigMode(nvmlDevice_t h, unsigned int *current, unsigned int *pending) {
    LOCKED(mig_mode_locked(h, current, pending));
}

static nvmlReturn_t max_mig_locked(nvmlDevice_t h, unsigned int *count) {
    struct fake_dev *d;
    nvmlReturn_t r = check(h, &d);
    if (r) return r;
    if (d->kind != 1 || !gpus[d->gpu].mig_capable) return NVML_ERROR_NOT_SUPPORTED;
    if (!count) return NVML_ERROR_INVALID_ARGUMENT;
    *count = MAX_MIG;
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlDeviceGetMaxMigDeviceCount(nvmlDevice_t h, unsigned int *count) { LOCKED(max_mig_locked(h, count)); }

static nvmlReturn_t mig_handle_locked(nvmlDevice_t h, unsigned int index, nvmlDevice_t *mig) {
    struct fake_dev *d;
    nvmlReturn_t r = check(h, &d);
    if (r) return r;
    struct fake_gpu *g = &gpus[d->gpu];
    if (d->kind != 1 || !g->mig_capable) return NVML_ERROR_NOT_SUPPORTED;
    if (!g->mig_current || !mig || index >= MAX_MIG) return NVML_ERROR_INVALID_ARGUMENT;
    if (!g->mig[index].present) return NVML_ERROR_NOT_FOUND;
    *mig = &g->mig[index];
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlDeviceGetMigDeviceHandleByIndex(nvmlDevice_t h, unsigned int index, nvmlDevice_t *mig) {
    LOCKED(mig_handle_locked(h, index, mig));
}

static nvmlReturn_t instance_id_locked(nvmlDevice_t h, unsigned int *id, int compute) {
    struct fake_dev *d;
    nvmlReturn_t r = check(h, &d);
    if (r) return r;
    if (d->kind != 2) return NVML_ERROR_INVALID_ARGUMENT;
    if (!id) return NVML_ERROR_INVALID_ARGUMENT;
    *id = compute ? d->ci : d->gi;
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlDeviceGetGpuInstanceId(nvmlDevice_t h, unsigned int *id) { LOCKED(instance_id_locked(h, id, 0)); }
nvmlReturn_t nvmlDeviceGetComputeInstanceId(nvmlDevice_t h, unsigned int *id) { LOCKED(instance_id_locked(h, id, 1)); }

/* -- events ------------------------------------------------------------------------------------------ */

nvmlReturn_t nvmlEventSetCreate(nvmlEventSet_t *set) {
    pthread_mutex_lock(&lock);
    nvmlReturn_t r = NVML_SUCCESS;
    if (refs == 0)
        r = NVML_ERROR_UNINITIALIZED;
    else if (!set)
        r = NVML_ERROR_INVALID_ARGUMENT;
    else if (!(*set = calloc(1, sizeof(struct fake_set))))
        r = NVML_ERROR_UNKNOWN;
    pthread_mutex_unlock(&lock);
    return r;
}

static nvmlReturn_t supported_locked(nvmlDevice_t h, unsigned long long *types) {
    struct fake_dev *d;
    nvmlReturn_t r = check(h, &d);
    if (r) return r;
    if (d->kind != 1 || !types) return NVML_ERROR_INVALID_ARGUMENT;
    *types = SUPPORTED_EVENTS;
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlDeviceGetSupportedEventTypes(nvmlDevice_t h, unsigned long long *types) {
    LOCKED(supported_locked(h, types));
}

static nvmlReturn_t register_locked(nvmlDevice_t h, unsigned long long types, nvmlEventSet_t set) {
    struct fake_dev *d;
    nvmlReturn_t r = check(h, &d);
    if (r) return r;
    if (d->kind != 1 || !set) return NVML_ERROR_INVALID_ARGUMENT;
    if (types & ~SUPPORTED_EVENTS) return NVML_ERROR_NOT_SUPPORTED;
    set->mask[d->gpu] |= types;
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlDeviceRegisterEvents(nvmlDevice_t h, unsigned long long types, nvmlEventSet_t set) {
    LOCKED(register_locked(h, types, set));
}

/* The next queued event this set listens to; events nobody listens to are dropped. */
static int next_event_locked(nvmlEventSet_t set, nvmlEventData_t *data) {
    while (events_delivered < event_count) {
        struct fake_event *e = &events[events_delivered++];
        if (e->gpu < gpu_count && (set->mask[e->gpu] & e->type)) {
            data->device = &gpus[e->gpu].dev;
            data->eventType = e->type;
            data->eventData = e->data;
            data->gpuInstanceId = e->gi;
            data->computeInstanceId = e->ci;
            return 1;
        }
    }
    return 0;
}

nvmlReturn_t nvmlEventSetWait_v2(nvmlEventSet_t set, nvmlEventData_t *data, unsigned int timeoutms) {
    if (!set || !data) return NVML_ERROR_INVALID_ARGUMENT;
    unsigned int waited = 0;
    for (;;) {
        pthread_mutex_lock(&lock);
        if (refs == 0) {
            pthread_mutex_unlock(&lock);
            return NVML_ERROR_UNINITIALIZED;
        }
        int got = next_event_locked(set, data);
        pthread_mutex_unlock(&lock);
        if (got) return NVML_SUCCESS;
        if (waited >= timeoutms) return NVML_ERROR_TIMEOUT;
        unsigned int step = timeoutms - waited < 5 ? timeoutms - waited : 5;
        usleep(step * 1000);
        waited += step;
    }
}

nvmlReturn_t nvmlEventSetFree(nvmlEventSet_t set) {
    if (!set) return NVML_ERROR_INVALID_ARGUMENT;
    free(set);
    return NVML_SUCCESS;
}

/* ---- settings a tenant with root may change, and the calls that put them back ---- */

static void record(const char *what, int gpu, long long value) {
    const char *path = getenv("BERTH_FAKE_NVML_CALLS");
    if (!path) return;
    FILE *f = fopen(path, "a");
    if (!f) return;
    if (value < 0) fprintf(f, "%s %d\n", what, gpu);
    else fprintf(f, "%s %d %lld\n", what, gpu, value);
    fclose(f);
}

static nvmlReturn_t reset_locked(nvmlDevice_t h, const char *what) {
    struct fake_dev *d;
    nvmlReturn_t r = check(h, &d);
    if (r != NVML_SUCCESS) return r;
    if (d->kind != 1) return NVML_ERROR_NOT_SUPPORTED;
    record(what, d->gpu, -1);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceResetApplicationsClocks(nvmlDevice_t h) { LOCKED(reset_locked(h, "reset-applications-clocks")); }
nvmlReturn_t nvmlDeviceResetGpuLockedClocks(nvmlDevice_t h) { LOCKED(reset_locked(h, "reset-gpu-locked-clocks")); }
nvmlReturn_t nvmlDeviceResetMemoryLockedClocks(nvmlDevice_t h) { LOCKED(reset_locked(h, "reset-memory-locked-clocks")); }

static nvmlReturn_t power_locked(nvmlDevice_t h, unsigned int *limit, int want_default) {
    struct fake_dev *d;
    nvmlReturn_t r = check(h, &d);
    if (r != NVML_SUCCESS) return r;
    if (!limit) return NVML_ERROR_INVALID_ARGUMENT;
    if (d->kind != 1 || !gpus[d->gpu].power_supported) return NVML_ERROR_NOT_SUPPORTED;
    *limit = want_default ? gpus[d->gpu].power_default_mw : gpus[d->gpu].power_mw;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetPowerManagementDefaultLimit(nvmlDevice_t h, unsigned int *limit) {
    LOCKED(power_locked(h, limit, 1));
}
nvmlReturn_t nvmlDeviceGetPowerManagementLimit(nvmlDevice_t h, unsigned int *limit) { LOCKED(power_locked(h, limit, 0)); }

static nvmlReturn_t set_power_locked(nvmlDevice_t h, unsigned int limit) {
    struct fake_dev *d;
    nvmlReturn_t r = check(h, &d);
    if (r != NVML_SUCCESS) return r;
    if (d->kind != 1 || !gpus[d->gpu].power_supported) return NVML_ERROR_NOT_SUPPORTED;
    gpus[d->gpu].power_mw = limit;
    record("power-limit", d->gpu, limit);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceSetPowerManagementLimit(nvmlDevice_t h, unsigned int limit) { LOCKED(set_power_locked(h, limit)); }
