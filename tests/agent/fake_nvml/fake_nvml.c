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
 *   giprofile <gpuIndex> <profile> <sliceCount> <memMiB> <name>  (the GPU instance profiles a MIG GPU offers)
 *   gi <gpuIndex> <gi> <profile> <placementStart> <placementSize>  (a GPU instance, with or without MIG devices)
 *   mig <gpuIndex> <slot> <gi> <ci> <memMiB> <giProfile> <placementStart> <placementSize> <ciSlices> <uuid> <name...>
 *   proc <gpuIndex> <pid> <usedMiB> <gi> <ci>                 (a compute process holding the GPU)
 *   event <gpuIndex> <eventType> <eventData> <gi> <ci>      (4294967295: no id)
 *   power <gpuIndex> <defaultLimitMw> <limitMw>               (none: power limits not supported)
 *   epoch <n>
 *
 * MIG: each `mig` line is one compute instance (a MIG device) of the GPU
 * instance `gi` (made by its first line). The GPU and compute instance calls
 * (nvmlDeviceGetGpuInstances, ...CreateGpuInstanceWithPlacement,
 * nvmlGpuInstanceDestroy, nvmlGpuInstanceCreateComputeInstance,
 * nvmlComputeInstanceDestroy, nvmlDeviceSetMigMode) change the layout; it is
 * written to the side file <topology>.layout (with the topology's epoch, and
 * read back over the topology's MIG lines at every init while the epoch is
 * the same), so a change outlives nvmlShutdown and reaches other processes,
 * as on a real GPU. What the fake decides where the driver would: a new GPU
 * instance takes the lowest free id from 1, a compute instance the lowest
 * from 0; a new MIG device takes the slot at its placement start plus its
 * compute instance id (the lowest free slot when that is taken) and a fresh
 * random UUID; a MIG mode change applies at once (no GPU reset); a GPU has
 * 7 slices. The driver's refusals are kept: a GPU instance with compute
 * instances, or MIG mode with GPU instances or processes, is IN_USE.
 *
 * The calls that change a GPU (clocks, the power limit, MIG mode and
 * instances) are written, one line each, to the file named by
 * $BERTH_FAKE_NVML_CALLS, so a test sees what the agent did:
 * `reset-applications-clocks <gpu>`, `power-limit <gpu> <mw>`, `mig-mode <gpu>
 * <mode>`, `gi-create <gpu> <gi> <profile> <start>`, `gi-destroy <gpu> <gi>`,
 * `ci-create <gpu> <gi> <ci> <slot>`, `ci-destroy <gpu> <gi> <ci>`.
 *
 * Events are handed out once each, in file order, across re-reads of the
 * same epoch; a file with a new epoch starts its queue from the top.
 * Struct layouts follow nvml.h as nvidia-ml-py declares them (nvmlPciInfo_t
 * v3, nvmlMemory_t, nvmlEventData_t, nvmlGpuInstancePlacement_t,
 * nvmlGpuInstanceProfileInfo_v2_t, nvmlGpuInstanceInfo_t,
 * nvmlComputeInstanceProfileInfo_v2_t, nvmlComputeInstanceInfo_t,
 * nvmlProcessInfo_v2_t).
 */
#include <pthread.h>
#include <stdarg.h>
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
    NVML_ERROR_IN_USE = 19,
    NVML_ERROR_INSUFFICIENT_RESOURCES = 23,
    NVML_ERROR_ARGUMENT_VERSION_MISMATCH = 25,
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
#define SLICES 7
#define MAX_GI 7
#define MAX_PROCS 16
#define GI_PROFILES 18 /* NVML_GPU_INSTANCE_PROFILE_COUNT */
#define CI_PROFILES 9  /* NVML_COMPUTE_INSTANCE_PROFILE_COUNT */
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
    int kind; /* 1: a GPU, 2: a MIG device (a compute instance) */
    int gpu;
    int slot;
    int present;
    unsigned int gi, ci;
    unsigned int ci_slices; /* a MIG device: the slices of its compute instance */
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

struct fake_profile {
    int present;
    unsigned int slices;
    unsigned long long mem_mib;
    char name[64]; /* e.g. 1g.10gb */
};

struct fake_gi {
    int present;
    int gpu;
    unsigned int id, profile, start, size;
};
typedef struct fake_gi *nvmlGpuInstance_t;
typedef struct fake_dev *nvmlComputeInstance_t;

struct fake_proc {
    unsigned int pid, gi, ci;
    unsigned long long used_mib;
};

struct fake_gpu {
    struct fake_dev dev;
    unsigned int minor;
    int mig_capable, mig_current, mig_pending, lost;
    int power_supported;
    unsigned int power_default_mw, power_mw;
    char pci[32];
    struct fake_dev mig[MAX_MIG];
    struct fake_profile profiles[GI_PROFILES];
    struct fake_gi gis[MAX_GI];
    struct fake_proc procs[MAX_PROCS];
    int proc_count;
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

static char topology_path[4096];

static struct fake_gi *gi_by_id(struct fake_gpu *g, unsigned int id) {
    for (int i = 0; i < MAX_GI; i++)
        if (g->gis[i].present && g->gis[i].id == id) return &g->gis[i];
    return NULL;
}

static struct fake_gi *add_gi(int gpu, unsigned int id, unsigned int profile, unsigned int start, unsigned int size) {
    struct fake_gpu *g = &gpus[gpu];
    struct fake_gi *gi = gi_by_id(g, id);
    for (int i = 0; !gi && i < MAX_GI; i++)
        if (!g->gis[i].present) gi = &g->gis[i];
    if (!gi) return NULL;
    *gi = (struct fake_gi){.present = 1, .gpu = gpu, .id = id, .profile = profile, .start = start, .size = size};
    return gi;
}

/* A `gi` or `mig` line, of the topology or of the side file. */
static void parse_layout_line(const char *line) {
    int gpu, slot, n = 0;
    unsigned int gi, ci, prof, start, size, slices;
    unsigned long long mem;
    char uuid[96];
    if (sscanf(line, "gi %d %u %u %u %u", &gpu, &gi, &prof, &start, &size) == 5) {
        if (gpu >= 0 && gpu < MAX_GPUS) add_gi(gpu, gi, prof, start, size);
        return;
    }
    if (sscanf(line, "mig %d %d %u %u %llu %u %u %u %u %95s %n", &gpu, &slot, &gi, &ci, &mem, &prof, &start, &size,
               &slices, uuid, &n) < 10 || gpu < 0 || gpu >= MAX_GPUS || slot < 0 || slot >= MAX_MIG)
        return;
    if (!add_gi(gpu, gi, prof, start, size)) return;
    struct fake_dev *d = &gpus[gpu].mig[slot];
    d->kind = 2;
    d->gpu = gpu;
    d->slot = slot;
    d->present = 1;
    d->gi = gi;
    d->ci = ci;
    d->ci_slices = slices;
    d->mem_mib = mem;
    snprintf(d->uuid, sizeof d->uuid, "%s", uuid);
    rest_of_line(d->name, sizeof d->name, line + n);
}

/* The side file's layout, when it is of this epoch: MIG modes, GPU instances and MIG devices of every GPU. */
static void load_layout(void) {
    char path[4200], line[512];
    snprintf(path, sizeof path, "%s.layout", topology_path);
    FILE *f = fopen(path, "r");
    if (!f) return;
    unsigned long long e;
    if (!fgets(line, sizeof line, f) || sscanf(line, "epoch %llu", &e) != 1 || e != epoch) {
        fclose(f);
        return;
    }
    for (int i = 0; i < MAX_GPUS; i++) {
        memset(gpus[i].mig, 0, sizeof gpus[i].mig);
        memset(gpus[i].gis, 0, sizeof gpus[i].gis);
    }
    while (fgets(line, sizeof line, f)) {
        int gpu, cur, pend;
        if (sscanf(line, "migmode %d %d %d", &gpu, &cur, &pend) == 3 && gpu >= 0 && gpu < MAX_GPUS) {
            gpus[gpu].mig_current = cur;
            gpus[gpu].mig_pending = pend;
        } else {
            parse_layout_line(line);
        }
    }
    fclose(f);
}

/* Write the layout of every GPU to the side file (atomically: other processes read it at their init). */
static void save_layout(void) {
    char path[4200], tmp[4300];
    snprintf(path, sizeof path, "%s.layout", topology_path);
    snprintf(tmp, sizeof tmp, "%s.%d.tmp", path, (int)getpid());
    FILE *f = fopen(tmp, "w");
    if (!f) return;
    fprintf(f, "epoch %llu\n", epoch);
    for (int i = 0; i < gpu_count; i++) {
        struct fake_gpu *g = &gpus[i];
        if (!g->mig_capable) continue;
        fprintf(f, "migmode %d %d %d\n", i, g->mig_current, g->mig_pending);
        for (int k = 0; k < MAX_GI; k++)
            if (g->gis[k].present)
                fprintf(f, "gi %d %u %u %u %u\n", i, g->gis[k].id, g->gis[k].profile, g->gis[k].start, g->gis[k].size);
        for (int s = 0; s < MAX_MIG; s++) {
            struct fake_dev *d = &g->mig[s];
            struct fake_gi *gi = d->present ? gi_by_id(g, d->gi) : NULL;
            if (gi)
                fprintf(f, "mig %d %d %u %u %llu %u %u %u %u %s %s\n", i, s, d->gi, d->ci, d->mem_mib, gi->profile,
                        gi->start, gi->size, d->ci_slices, d->uuid, d->name);
        }
    }
    fclose(f);
    rename(tmp, path);
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
    snprintf(topology_path, sizeof topology_path, "%s", path);
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
        } else if (strncmp(line, "giprofile ", 10) == 0) {
            int gpu;
            unsigned int prof, slices;
            unsigned long long mem;
            if (sscanf(line, "giprofile %d %u %u %llu %63s", &gpu, &prof, &slices, &mem, word) == 5 && gpu >= 0 &&
                gpu < MAX_GPUS && prof < GI_PROFILES) {
                struct fake_profile *p = &gpus[gpu].profiles[prof];
                p->present = 1;
                p->slices = slices;
                p->mem_mib = mem;
                snprintf(p->name, sizeof p->name, "%s", word);
            }
        } else if (strncmp(line, "proc ", 5) == 0) {
            int gpu;
            struct fake_proc pr;
            if (sscanf(line, "proc %d %u %llu %u %u", &gpu, &pr.pid, &pr.used_mib, &pr.gi, &pr.ci) == 5 && gpu >= 0 &&
                gpu < MAX_GPUS && gpus[gpu].proc_count < MAX_PROCS)
                gpus[gpu].procs[gpus[gpu].proc_count++] = pr;
        } else if (strncmp(line, "gi ", 3) == 0 || strncmp(line, "mig ", 4) == 0) {
            parse_layout_line(line);
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
    load_layout();
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
    case NVML_ERROR_IN_USE: return "In use by another client";
    case NVML_ERROR_INSUFFICIENT_RESOURCES: return "Insufficient resources";
    case NVML_ERROR_ARGUMENT_VERSION_MISMATCH: return "Argument version mismatch";
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

static void record(const char *fmt, ...) {
    const char *path = getenv("BERTH_FAKE_NVML_CALLS");
    if (!path) return;
    FILE *f = fopen(path, "a");
    if (!f) return;
    va_list ap;
    va_start(ap, fmt);
    vfprintf(f, fmt, ap);
    va_end(ap);
    fputc('\n', f);
    fclose(f);
}

static nvmlReturn_t reset_locked(nvmlDevice_t h, const char *what) {
    struct fake_dev *d;
    nvmlReturn_t r = check(h, &d);
    if (r != NVML_SUCCESS) return r;
    if (d->kind != 1) return NVML_ERROR_NOT_SUPPORTED;
    record("%s %d", what, d->gpu);
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
    record("power-limit %d %u", d->gpu, limit);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceSetPowerManagementLimit(nvmlDevice_t h, unsigned int limit) { LOCKED(set_power_locked(h, limit)); }

/* ---- MIG: GPU instances, compute instances, the MIG mode (a tenant with root may change them all) ---- */

typedef struct {
    unsigned int start;
    unsigned int size;
} nvmlGpuInstancePlacement_t;

typedef struct {
    unsigned int version;
    unsigned int id;
    unsigned int isP2pSupported;
    unsigned int sliceCount;
    unsigned int instanceCount;
    unsigned int multiprocessorCount;
    unsigned int copyEngineCount;
    unsigned int decoderCount;
    unsigned int encoderCount;
    unsigned int jpegCount;
    unsigned int ofaCount;
    unsigned long long memorySizeMB;
    char name[96];
} nvmlGpuInstanceProfileInfo_v2_t;
#define GI_PROFILE_INFO_V2 (sizeof(nvmlGpuInstanceProfileInfo_v2_t) | (2 << 24))

typedef struct {
    nvmlDevice_t device;
    unsigned int id;
    unsigned int profileId;
    nvmlGpuInstancePlacement_t placement;
} nvmlGpuInstanceInfo_t;

typedef struct {
    unsigned int version;
    unsigned int id;
    unsigned int sliceCount;
    unsigned int instanceCount;
    unsigned int multiprocessorCount;
    unsigned int sharedCopyEngineCount;
    unsigned int sharedDecoderCount;
    unsigned int sharedEncoderCount;
    unsigned int sharedJpegCount;
    unsigned int sharedOfaCount;
    char name[96];
} nvmlComputeInstanceProfileInfo_v2_t;
#define CI_PROFILE_INFO_V2 (sizeof(nvmlComputeInstanceProfileInfo_v2_t) | (2 << 24))

typedef struct {
    unsigned int start;
    unsigned int size;
} nvmlComputeInstancePlacement_t;

typedef struct {
    nvmlDevice_t device;
    nvmlGpuInstance_t gpuInstance;
    unsigned int id;
    unsigned int profileId;
    nvmlComputeInstancePlacement_t placement;
} nvmlComputeInstanceInfo_t;

typedef struct {
    unsigned int pid;
    unsigned long long usedGpuMemory;
    unsigned int gpuInstanceId;
    unsigned int computeInstanceId;
} nvmlProcessInfo_t;

/* Compute instance profiles by NVML_COMPUTE_INSTANCE_PROFILE_* index: their slices (0: none). */
static const unsigned int ci_profile_slices[CI_PROFILES] = {1, 2, 3, 4, 7, 8, 6, 0, 0};

/* A GPU that is MIG-capable and in MIG mode, for a GPU handle. */
static nvmlReturn_t mig_gpu(nvmlDevice_t h, struct fake_gpu **out) {
    struct fake_dev *d;
    nvmlReturn_t r = check(h, &d);
    if (r) return r;
    if (d->kind != 1 || !gpus[d->gpu].mig_capable) return NVML_ERROR_NOT_SUPPORTED;
    *out = &gpus[d->gpu];
    return NVML_SUCCESS;
}

/* The GPU instance behind a handle this library gave out and has not destroyed. */
static nvmlReturn_t gi_of(nvmlGpuInstance_t h, struct fake_gi **out) {
    if (refs == 0) return NVML_ERROR_UNINITIALIZED;
    for (int i = 0; i < gpu_count; i++)
        for (int k = 0; k < MAX_GI; k++)
            if (h == &gpus[i].gis[k]) {
                if (!h->present) return NVML_ERROR_INVALID_ARGUMENT;
                if (gpus[i].lost) return NVML_ERROR_GPU_IS_LOST;
                *out = h;
                return NVML_SUCCESS;
            }
    return NVML_ERROR_INVALID_ARGUMENT;
}

static nvmlReturn_t ci_of(nvmlComputeInstance_t h, struct fake_dev **out) {
    struct fake_dev *d;
    nvmlReturn_t r = check(h, &d);
    if (r) return r;
    if (d->kind != 2) return NVML_ERROR_INVALID_ARGUMENT;
    *out = d;
    return NVML_SUCCESS;
}

static int gi_has_cis(struct fake_gi *gi) {
    for (int s = 0; s < MAX_MIG; s++)
        if (gpus[gi->gpu].mig[s].present && gpus[gi->gpu].mig[s].gi == gi->id) return 1;
    return 0;
}

static int gpu_has_gis(struct fake_gpu *g) {
    for (int k = 0; k < MAX_GI; k++)
        if (g->gis[k].present) return 1;
    return 0;
}

static nvmlReturn_t set_mig_mode_locked(nvmlDevice_t h, unsigned int mode, nvmlReturn_t *activation) {
    struct fake_gpu *g;
    nvmlReturn_t r = mig_gpu(h, &g);
    if (r) return r;
    if (!activation || mode > 1) return NVML_ERROR_INVALID_ARGUMENT;
    if (g->proc_count > 0) return NVML_ERROR_IN_USE;
    if (!mode && gpu_has_gis(g)) return NVML_ERROR_IN_USE; /* the driver wants the instances gone first */
    g->mig_current = g->mig_pending = (int)mode;
    *activation = NVML_SUCCESS;
    record("mig-mode %d %u", g->dev.gpu, mode);
    save_layout();
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlDeviceSetMigMode(nvmlDevice_t h, unsigned int mode, nvmlReturn_t *activationStatus) {
    LOCKED(set_mig_mode_locked(h, mode, activationStatus));
}

static nvmlReturn_t gi_profile_locked(nvmlDevice_t h, unsigned int profile, nvmlGpuInstanceProfileInfo_v2_t *info) {
    struct fake_gpu *g;
    nvmlReturn_t r = mig_gpu(h, &g);
    if (r) return r;
    if (!info) return NVML_ERROR_INVALID_ARGUMENT;
    if (info->version != GI_PROFILE_INFO_V2) return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    if (profile >= GI_PROFILES || !g->profiles[profile].present) return NVML_ERROR_NOT_SUPPORTED;
    struct fake_profile *p = &g->profiles[profile];
    memset(info, 0, sizeof *info);
    info->version = GI_PROFILE_INFO_V2;
    info->id = profile;
    info->sliceCount = p->slices;
    info->instanceCount = SLICES / p->slices;
    info->multiprocessorCount = 14 * p->slices;
    info->copyEngineCount = p->slices;
    info->memorySizeMB = p->mem_mib;
    snprintf(info->name, sizeof info->name, "MIG %s", p->name);
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlDeviceGetGpuInstanceProfileInfoV(nvmlDevice_t h, unsigned int profile,
                                                  nvmlGpuInstanceProfileInfo_v2_t *info) {
    LOCKED(gi_profile_locked(h, profile, info));
}

static nvmlReturn_t gpu_instances_locked(nvmlDevice_t h, unsigned int profile, nvmlGpuInstance_t *out,
                                         unsigned int *count) {
    struct fake_gpu *g;
    nvmlReturn_t r = mig_gpu(h, &g);
    if (r) return r;
    if (!out || !count) return NVML_ERROR_INVALID_ARGUMENT;
    if (!g->mig_current) return NVML_ERROR_NOT_SUPPORTED;
    if (profile >= GI_PROFILES || !g->profiles[profile].present) return NVML_ERROR_INVALID_ARGUMENT;
    unsigned int n = 0;
    for (int k = 0; k < MAX_GI; k++)
        if (g->gis[k].present && g->gis[k].profile == profile) out[n++] = &g->gis[k];
    *count = n;
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlDeviceGetGpuInstances(nvmlDevice_t h, unsigned int profile, nvmlGpuInstance_t *instances,
                                       unsigned int *count) {
    LOCKED(gpu_instances_locked(h, profile, instances, count));
}

static nvmlReturn_t create_gi_locked(nvmlDevice_t h, unsigned int profile, const nvmlGpuInstancePlacement_t *where,
                                     nvmlGpuInstance_t *out) {
    struct fake_gpu *g;
    nvmlReturn_t r = mig_gpu(h, &g);
    if (r) return r;
    if (!where || !out) return NVML_ERROR_INVALID_ARGUMENT;
    if (!g->mig_current) return NVML_ERROR_NOT_SUPPORTED;
    if (profile >= GI_PROFILES || !g->profiles[profile].present) return NVML_ERROR_INVALID_ARGUMENT;
    if (where->size != g->profiles[profile].slices || where->start + where->size > SLICES)
        return NVML_ERROR_INVALID_ARGUMENT;
    unsigned int used = 0; /* slices taken, and GI ids taken, as bit sets */
    unsigned int ids = 0;
    for (int k = 0; k < MAX_GI; k++)
        if (g->gis[k].present) {
            used |= ((1u << g->gis[k].size) - 1) << g->gis[k].start;
            ids |= 1u << g->gis[k].id;
        }
    if (used & (((1u << where->size) - 1) << where->start)) return NVML_ERROR_INSUFFICIENT_RESOURCES;
    unsigned int id = 1;
    while (ids & (1u << id)) id++;
    struct fake_gi *gi = add_gi(g->dev.gpu, id, profile, where->start, where->size);
    if (!gi) return NVML_ERROR_INSUFFICIENT_RESOURCES;
    *out = gi;
    record("gi-create %d %u %u %u", g->dev.gpu, id, profile, where->start);
    save_layout();
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlDeviceCreateGpuInstanceWithPlacement(nvmlDevice_t h, unsigned int profile,
                                                      const nvmlGpuInstancePlacement_t *placement,
                                                      nvmlGpuInstance_t *gpuInstance) {
    LOCKED(create_gi_locked(h, profile, placement, gpuInstance));
}

static nvmlReturn_t destroy_gi_locked(nvmlGpuInstance_t h) {
    struct fake_gi *gi;
    nvmlReturn_t r = gi_of(h, &gi);
    if (r) return r;
    if (gi_has_cis(gi)) return NVML_ERROR_IN_USE; /* its compute instances go first */
    gi->present = 0;
    record("gi-destroy %d %u", gi->gpu, gi->id);
    save_layout();
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlGpuInstanceDestroy(nvmlGpuInstance_t gpuInstance) { LOCKED(destroy_gi_locked(gpuInstance)); }

static nvmlReturn_t gi_info_locked(nvmlGpuInstance_t h, nvmlGpuInstanceInfo_t *info) {
    struct fake_gi *gi;
    nvmlReturn_t r = gi_of(h, &gi);
    if (r) return r;
    if (!info) return NVML_ERROR_INVALID_ARGUMENT;
    info->device = &gpus[gi->gpu].dev;
    info->id = gi->id;
    info->profileId = gi->profile;
    info->placement.start = gi->start;
    info->placement.size = gi->size;
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlGpuInstanceGetInfo(nvmlGpuInstance_t gpuInstance, nvmlGpuInstanceInfo_t *info) {
    LOCKED(gi_info_locked(gpuInstance, info));
}

static nvmlReturn_t ci_profile_locked(nvmlGpuInstance_t h, unsigned int profile, unsigned int eng,
                                      nvmlComputeInstanceProfileInfo_v2_t *info) {
    struct fake_gi *gi;
    nvmlReturn_t r = gi_of(h, &gi);
    if (r) return r;
    if (!info || eng != 0) return NVML_ERROR_INVALID_ARGUMENT;
    if (info->version != CI_PROFILE_INFO_V2) return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    if (profile >= CI_PROFILES || !ci_profile_slices[profile] || ci_profile_slices[profile] > gi->size)
        return NVML_ERROR_NOT_SUPPORTED;
    unsigned int slices = ci_profile_slices[profile];
    memset(info, 0, sizeof *info);
    info->version = CI_PROFILE_INFO_V2;
    info->id = profile;
    info->sliceCount = slices;
    info->instanceCount = gi->size / slices;
    info->multiprocessorCount = 14 * slices;
    const char *gi_name = gpus[gi->gpu].profiles[gi->profile].name;
    if (slices == gi->size)
        snprintf(info->name, sizeof info->name, "MIG %s", gi_name);
    else
        snprintf(info->name, sizeof info->name, "MIG %uc.%s", slices, gi_name);
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlGpuInstanceGetComputeInstanceProfileInfoV(nvmlGpuInstance_t gpuInstance, unsigned int profile,
                                                           unsigned int engProfile,
                                                           nvmlComputeInstanceProfileInfo_v2_t *info) {
    LOCKED(ci_profile_locked(gpuInstance, profile, engProfile, info));
}

static unsigned int ci_profile_of(unsigned int slices) {
    for (unsigned int p = 0; p < CI_PROFILES; p++)
        if (ci_profile_slices[p] == slices) return p;
    return 0;
}

static void fresh_uuid(char *out, size_t size) {
    unsigned char b[16] = {0};
    FILE *f = fopen("/dev/urandom", "rb");
    if (f) {
        if (fread(b, 1, sizeof b, f) != sizeof b) memset(b, 0x5a, sizeof b);
        fclose(f);
    }
    snprintf(out, size, "MIG-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", b[0], b[1], b[2],
             b[3], b[4], b[5], (b[6] & 0x0f) | 0x40, b[7], (b[8] & 0x3f) | 0x80, b[9], b[10], b[11], b[12], b[13],
             b[14], b[15]);
}

static nvmlReturn_t create_ci_locked(nvmlGpuInstance_t h, unsigned int profile, nvmlComputeInstance_t *out) {
    struct fake_gi *gi;
    nvmlReturn_t r = gi_of(h, &gi);
    if (r) return r;
    if (!out || profile >= CI_PROFILES || !ci_profile_slices[profile] || ci_profile_slices[profile] > gi->size)
        return NVML_ERROR_INVALID_ARGUMENT;
    struct fake_gpu *g = &gpus[gi->gpu];
    unsigned int slices = ci_profile_slices[profile], taken = 0, ids = 0;
    for (int s = 0; s < MAX_MIG; s++)
        if (g->mig[s].present && g->mig[s].gi == gi->id) {
            taken += g->mig[s].ci_slices;
            ids |= 1u << g->mig[s].ci;
        }
    if (taken + slices > gi->size) return NVML_ERROR_INSUFFICIENT_RESOURCES;
    unsigned int ci = 0;
    while (ids & (1u << ci)) ci++;
    int slot = (int)(gi->start + ci);
    if (slot >= MAX_MIG || g->mig[slot].present)
        for (slot = 0; slot < MAX_MIG && g->mig[slot].present; slot++) {
        }
    if (slot >= MAX_MIG) return NVML_ERROR_INSUFFICIENT_RESOURCES;
    struct fake_dev *d = &g->mig[slot];
    memset(d, 0, sizeof *d);
    d->kind = 2;
    d->gpu = gi->gpu;
    d->slot = slot;
    d->present = 1;
    d->gi = gi->id;
    d->ci = ci;
    d->ci_slices = slices;
    d->mem_mib = g->profiles[gi->profile].mem_mib;
    fresh_uuid(d->uuid, sizeof d->uuid);
    char gpu_name[96], gi_name[64];
    snprintf(gpu_name, sizeof gpu_name, "%s", g->dev.name);
    snprintf(gi_name, sizeof gi_name, "%s", g->profiles[gi->profile].name);
    if (slices == gi->size)
        snprintf(d->name, sizeof d->name, "%.56s MIG %.30s", gpu_name, gi_name);
    else
        snprintf(d->name, sizeof d->name, "%.48s MIG %uc.%.30s", gpu_name, slices, gi_name);
    *out = d;
    record("ci-create %d %u %u %d", gi->gpu, gi->id, ci, slot);
    save_layout();
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlGpuInstanceCreateComputeInstance(nvmlGpuInstance_t gpuInstance, unsigned int profile,
                                                  nvmlComputeInstance_t *computeInstance) {
    LOCKED(create_ci_locked(gpuInstance, profile, computeInstance));
}

static nvmlReturn_t destroy_ci_locked(nvmlComputeInstance_t h) {
    struct fake_dev *d;
    nvmlReturn_t r = ci_of(h, &d);
    if (r) return r;
    struct fake_gpu *g = &gpus[d->gpu];
    for (int i = 0; i < g->proc_count; i++)
        if (g->procs[i].gi == d->gi && g->procs[i].ci == d->ci) return NVML_ERROR_IN_USE;
    d->present = 0;
    record("ci-destroy %d %u %u", d->gpu, d->gi, d->ci);
    save_layout();
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlComputeInstanceDestroy(nvmlComputeInstance_t computeInstance) {
    LOCKED(destroy_ci_locked(computeInstance));
}

static nvmlReturn_t compute_instances_locked(nvmlGpuInstance_t h, unsigned int profile, nvmlComputeInstance_t *out,
                                             unsigned int *count) {
    struct fake_gi *gi;
    nvmlReturn_t r = gi_of(h, &gi);
    if (r) return r;
    if (!out || !count || profile >= CI_PROFILES) return NVML_ERROR_INVALID_ARGUMENT;
    unsigned int n = 0;
    struct fake_gpu *g = &gpus[gi->gpu];
    for (int s = 0; s < MAX_MIG; s++)
        if (g->mig[s].present && g->mig[s].gi == gi->id && ci_profile_of(g->mig[s].ci_slices) == profile)
            out[n++] = &g->mig[s];
    *count = n;
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlGpuInstanceGetComputeInstances(nvmlGpuInstance_t gpuInstance, unsigned int profile,
                                                nvmlComputeInstance_t *computeInstances, unsigned int *count) {
    LOCKED(compute_instances_locked(gpuInstance, profile, computeInstances, count));
}

static nvmlReturn_t ci_info_locked(nvmlComputeInstance_t h, nvmlComputeInstanceInfo_t *info) {
    struct fake_dev *d;
    nvmlReturn_t r = ci_of(h, &d);
    if (r) return r;
    if (!info) return NVML_ERROR_INVALID_ARGUMENT;
    struct fake_gpu *g = &gpus[d->gpu];
    info->device = &g->dev;
    info->gpuInstance = gi_by_id(g, d->gi);
    info->id = d->ci;
    info->profileId = ci_profile_of(d->ci_slices);
    info->placement.start = d->ci;
    info->placement.size = d->ci_slices;
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlComputeInstanceGetInfo_v2(nvmlComputeInstance_t computeInstance, nvmlComputeInstanceInfo_t *info) {
    LOCKED(ci_info_locked(computeInstance, info));
}

static nvmlReturn_t processes_locked(nvmlDevice_t h, unsigned int *count, nvmlProcessInfo_t *infos) {
    struct fake_dev *d;
    nvmlReturn_t r = check(h, &d);
    if (r) return r;
    if (d->kind != 1 || !count) return NVML_ERROR_INVALID_ARGUMENT;
    struct fake_gpu *g = &gpus[d->gpu];
    if (*count < (unsigned int)g->proc_count || (!infos && g->proc_count)) {
        *count = (unsigned int)g->proc_count;
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    for (int i = 0; i < g->proc_count; i++)
        infos[i] = (nvmlProcessInfo_t){.pid = g->procs[i].pid, .usedGpuMemory = g->procs[i].used_mib << 20,
                                       .gpuInstanceId = g->procs[i].gi, .computeInstanceId = g->procs[i].ci};
    *count = (unsigned int)g->proc_count;
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t h, unsigned int *count, nvmlProcessInfo_t *infos) {
    LOCKED(processes_locked(h, count, infos));
}
