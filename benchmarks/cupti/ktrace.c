// A CUDA activity trace for benchmarks/kernel_trace.py: CUPTI's records of kernels, copies and memsets
// (GPU start/end) and, with KTRACE_API set, of runtime and driver API calls (host start/end), written
// one tab-separated line each: kind, start ns, end ns, stream or thread, grid, block, dynamic shared
// memory, name. Loaded with ctypes into the process it traces (no profiler, no kernel replay: kernels
// run as they do untraced, concurrently where they would). Built by build.sh.
#include <cupti.h>
#include <stdio.h>
#include <stdlib.h>

static FILE *out;

static void CUPTIAPI buffer_requested(uint8_t **buffer, size_t *size, size_t *max_records) {
  *size = 16 << 20;
  *buffer = (uint8_t *)aligned_alloc(ACTIVITY_RECORD_ALIGNMENT, *size);
  *max_records = 0;
}

static void CUPTIAPI buffer_completed(CUcontext ctx, uint32_t stream, uint8_t *buffer, size_t size, size_t valid) {
  CUpti_Activity *r = NULL;
  while (cuptiActivityGetNextRecord(buffer, valid, &r) == CUPTI_SUCCESS) {
    if (r->kind == CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL || r->kind == CUPTI_ACTIVITY_KIND_KERNEL) {
      CUpti_ActivityKernel10 *k = (CUpti_ActivityKernel10 *)r;
      fprintf(out, "kernel\t%llu\t%llu\t%u\t%d,%d,%d\t%d,%d,%d\t%d\t%s\n", (unsigned long long)k->start,
              (unsigned long long)k->end, k->streamId, k->gridX, k->gridY, k->gridZ, k->blockX, k->blockY,
              k->blockZ, k->dynamicSharedMemory, k->name);
    } else if (r->kind == CUPTI_ACTIVITY_KIND_MEMCPY) {
      CUpti_ActivityMemcpy6 *m = (CUpti_ActivityMemcpy6 *)r;
      fprintf(out, "memcpy\t%llu\t%llu\t%u\t\t\t%llu\tmemcpy kind %d\n", (unsigned long long)m->start,
              (unsigned long long)m->end, m->streamId, (unsigned long long)m->bytes, m->copyKind);
    } else if (r->kind == CUPTI_ACTIVITY_KIND_MEMSET) {
      CUpti_ActivityMemset4 *m = (CUpti_ActivityMemset4 *)r;
      fprintf(out, "memset\t%llu\t%llu\t%u\t\t\t%llu\tmemset\n", (unsigned long long)m->start,
              (unsigned long long)m->end, m->streamId, (unsigned long long)m->bytes);
    } else if (r->kind == CUPTI_ACTIVITY_KIND_RUNTIME || r->kind == CUPTI_ACTIVITY_KIND_DRIVER) {
      CUpti_ActivityAPI *a = (CUpti_ActivityAPI *)r;
      int runtime = r->kind == CUPTI_ACTIVITY_KIND_RUNTIME;
      const char *name = "?";
      cuptiGetCallbackName(runtime ? CUPTI_CB_DOMAIN_RUNTIME_API : CUPTI_CB_DOMAIN_DRIVER_API, a->cbid, &name);
      fprintf(out, "%s\t%llu\t%llu\t%u\t\t\t\t%s\n", runtime ? "runtime" : "driver", (unsigned long long)a->start,
              (unsigned long long)a->end, a->threadId, name);
    }
  }
  free(buffer);
}

static const CUpti_ActivityKind GPU_KINDS[] = {CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL, CUPTI_ACTIVITY_KIND_MEMCPY,
                                               CUPTI_ACTIVITY_KIND_MEMSET};
static const CUpti_ActivityKind API_KINDS[] = {CUPTI_ACTIVITY_KIND_RUNTIME, CUPTI_ACTIVITY_KIND_DRIVER};

// Start recording into `path` (api: also the host's CUDA API calls). 0 on success.
int ktrace_start(const char *path, int api) {
  out = fopen(path, "w");
  if (!out) return -1;
  int rc = cuptiActivityRegisterCallbacks(buffer_requested, buffer_completed);
  for (int i = 0; i < 3; i++) rc |= cuptiActivityEnable(GPU_KINDS[i]);
  for (int i = 0; api && i < 2; i++) rc |= cuptiActivityEnable(API_KINDS[i]);
  return rc;
}

// Stop, write every record so far and close the file. 0 on success.
int ktrace_stop(void) {
  int rc = cuptiActivityFlushAll(1);
  for (int i = 0; i < 3; i++) cuptiActivityDisable(GPU_KINDS[i]);
  for (int i = 0; i < 2; i++) cuptiActivityDisable(API_KINDS[i]);
  rc |= cuptiActivityFlushAll(1);
  fclose(out);
  return rc;
}

// CUPTI's clock (ns), the one its records use: for host-side marks on the same time line.
unsigned long long ktrace_now(void) {
  uint64_t t = 0;
  cuptiGetTimestamp(&t);
  return (unsigned long long)t;
}
