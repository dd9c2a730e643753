/* Raw libfabric baseline: half round trip of fi_writedata (RMA write + remote CQ data) between two
 * processes, with no engine in between. One thread per process busy-polls a single CQ. The
 * round trips of a size are timed in blocks (-b, default 20); the median and best block are
 * printed, so that a busy machine disturbs the numbers less.
 *
 * Build:  gcc -O2 -o /tmp/fi_writedata_pingpong cc/transfer/tools/fi_writedata_pingpong.c -lfabric
 * Run:    mpirun --allow-run-as-root -n 2 /tmp/fi_writedata_pingpong -p shm
 *         mpirun --allow-run-as-root -n 2 /tmp/fi_writedata_pingpong -p "tcp;ofi_rxm" -i lo
 * Options: -n round trips per size (20000), -b blocks, -i domain/interface name, -p provider.
 * Ranks come from OMPI_COMM_WORLD_RANK (or -r); addresses are swapped through files in -d DIR
 * (default /tmp/fi_wd_pp.$OMPI_MCA_ess_base_jobid or /tmp/fi_wd_pp). Prints one line per size. */
#define _GNU_SOURCE
#include <rdma/fabric.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_rma.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define CHECK(call)                                                                   \
  do {                                                                                \
    int _rc = (int)(call);                                                            \
    if (_rc) {                                                                        \
      fprintf(stderr, "%s failed: %s (%d)\n", #call, fi_strerror(-_rc), _rc);         \
      exit(1);                                                                        \
    }                                                                                 \
  } while (0)

struct blob {
  unsigned long long session[2]; /* parent pid and its start time: stale files of old runs differ */
  uint64_t addr, key;
  size_t namelen;
  char name[256];
};

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* The launcher (our parent, shared by both ranks) identifies the run. */
static void session_id(unsigned long long out[2]) {
  char path[64], line[1024];
  out[0] = (unsigned long long)getppid();
  out[1] = 0;
  snprintf(path, sizeof path, "/proc/%llu/stat", out[0]);
  FILE* f = fopen(path, "r");
  if (!f) return;
  if (fgets(line, sizeof line, f)) {
    char* p = strrchr(line, ')'); /* fields after the command name; starttime is field 22 */
    for (int field = 2; p && field < 22; field++) p = strchr(p + 1, ' ');
    if (p) out[1] = strtoull(p + 1, NULL, 10);
  }
  fclose(f);
}

static int cmp_double(const void* a, const void* b) {
  double x = *(const double*)a, y = *(const double*)b;
  return (x > y) - (x < y);
}

static struct fid_cq* cq;
static struct fid_ep* ep;

/* Polls until one remote-CQ-data arrival was seen; tx completions are drained on the way. */
static void wait_arrival(int* arrivals) {
  struct fi_cq_data_entry e[16];
  while (*arrivals == 0) {
    ssize_t n = fi_cq_read(cq, e, 16);
    if (n == -FI_EAGAIN) continue;
    if (n < 0) {
      struct fi_cq_err_entry err = {0};
      fi_cq_readerr(cq, &err, 0);
      fprintf(stderr, "cq error: %s\n", fi_cq_strerror(cq, err.prov_errno, err.err_data, NULL, 0));
      exit(1);
    }
    for (ssize_t i = 0; i < n; i++)
      if (e[i].flags & FI_REMOTE_CQ_DATA) ++*arrivals;
  }
  --*arrivals;
}

int main(int argc, char** argv) {
  const char* prov = "shm";
  const char* iface = NULL;
  const char* env_rank = getenv("OMPI_COMM_WORLD_RANK");
  int rank = env_rank ? atoi(env_rank) : 0;
  int iters = 20000, blocks = 20;
  char dir[256];
  const char* job = getenv("OMPI_MCA_ess_base_jobid");
  snprintf(dir, sizeof dir, "/tmp/fi_wd_pp.%s", job ? job : "0");
  int opt;
  while ((opt = getopt(argc, argv, "p:i:r:n:d:b:")) != -1) {
    if (opt == 'p') prov = optarg;
    else if (opt == 'i') iface = optarg;
    else if (opt == 'r') rank = atoi(optarg);
    else if (opt == 'n') iters = atoi(optarg);
    else if (opt == 'd') snprintf(dir, sizeof dir, "%s", optarg);
    else if (opt == 'b') blocks = atoi(optarg) < 1 ? 1 : atoi(optarg) > 64 ? 64 : atoi(optarg);
  }

  struct fi_info* hints = fi_allocinfo();
  hints->caps = FI_RMA;
  hints->ep_attr->type = FI_EP_RDM;
  hints->domain_attr->mr_mode =
      FI_MR_LOCAL | FI_MR_VIRT_ADDR | FI_MR_ALLOCATED | FI_MR_PROV_KEY | FI_MR_ENDPOINT;
  hints->domain_attr->threading = FI_THREAD_DOMAIN;
  hints->fabric_attr->prov_name = strdup(prov);
  struct fi_info* all;
  CHECK(fi_getinfo(FI_VERSION(1, 17), NULL, NULL, 0, hints, &all));
  struct fi_info* info = all; /* the first entry, or the first one on interface/domain -i */
  while (iface && info && strcmp(info->domain_attr->name, iface) != 0) info = info->next;
  if (!info) {
    fprintf(stderr, "no %s domain named %s\n", prov, iface);
    return 1;
  }

  struct fid_fabric* fabric;
  struct fid_domain* domain;
  struct fid_av* av;
  CHECK(fi_fabric(info->fabric_attr, &fabric, NULL));
  CHECK(fi_domain(fabric, info, &domain, NULL));
  struct fi_cq_attr cq_attr = {.format = FI_CQ_FORMAT_DATA, .size = 1024, .wait_obj = FI_WAIT_NONE};
  CHECK(fi_cq_open(domain, &cq_attr, &cq, NULL));
  struct fi_av_attr av_attr = {.type = FI_AV_TABLE};
  CHECK(fi_av_open(domain, &av_attr, &av, NULL));
  CHECK(fi_endpoint(domain, info, &ep, NULL));
  CHECK(fi_ep_bind(ep, &av->fid, 0));
  CHECK(fi_ep_bind(ep, &cq->fid, FI_TRANSMIT | FI_RECV));
  CHECK(fi_enable(ep));

  const size_t max_size = 1 << 22;
  char* buf = aligned_alloc(4096, 2 * max_size);
  memset(buf, rank + 1, 2 * max_size);
  struct fid_mr* mr;
  uint64_t mr_mode = info->domain_attr->mr_mode;
  CHECK(fi_mr_reg(domain, buf, 2 * max_size, FI_WRITE | FI_REMOTE_WRITE, 0, 7, 0, &mr, NULL));
  if (mr_mode & FI_MR_ENDPOINT) {
    CHECK(fi_mr_bind(mr, &ep->fid, 0));
    CHECK(fi_mr_enable(mr));
  }
  void* desc = fi_mr_desc(mr);

  struct blob me = {0}, peer = {0};
  me.addr = (mr_mode & FI_MR_VIRT_ADDR) ? (uint64_t)(uintptr_t)buf : 0;
  me.key = fi_mr_key(mr);
  session_id(me.session);
  me.namelen = sizeof me.name;
  CHECK(fi_getname(&ep->fid, me.name, &me.namelen));
  mkdir(dir, 0700);
  char path[512], tmp[512];
  snprintf(tmp, sizeof tmp, "%s/%d.tmp", dir, rank);
  snprintf(path, sizeof path, "%s/%d", dir, rank);
  FILE* f = fopen(tmp, "wb");
  fwrite(&me, sizeof me, 1, f);
  fclose(f);
  rename(tmp, path);
  snprintf(path, sizeof path, "%s/%d", dir, 1 - rank);
  for (;;) {
    f = fopen(path, "rb");
    if (f && fread(&peer, sizeof peer, 1, f) == 1 && peer.session[0] == me.session[0] &&
        peer.session[1] == me.session[1])
      break;
    if (f) fclose(f);
    usleep(1000);
  }
  fclose(f);
  fi_addr_t peer_addr;
  if (fi_av_insert(av, peer.name, 1, &peer_addr, 0, NULL) != 1) {
    fprintf(stderr, "fi_av_insert failed\n");
    return 1;
  }

  if (rank == 0)
    printf("# raw fi_writedata ping-pong, provider %s (%s), mr_mode 0x%llx, %d iterations\n",
           info->fabric_attr->prov_name, info->domain_attr->name, (unsigned long long)mr_mode,
           iters);
  int arrivals = 0;
  if (rank == 0) printf("# size: half round trip in us, median and best of %d blocks\n", blocks);
  for (size_t size = 8; size <= max_size; size *= (size < 4096 ? 8 : 16)) {
    int n = size <= 65536 ? iters : iters / 20;
    int per_block = n / blocks > 0 ? n / blocks : 1;
    double times[64];
    for (int b = -1; b < blocks; b++) { /* block -1 warms up */
      double t0 = now_s();
      for (int i = 0; i < per_block; i++) {
        if (rank == 1) wait_arrival(&arrivals);
        ssize_t rc;
        while ((rc = fi_writedata(ep, buf, size, desc, (uint64_t)i, peer_addr,
                                  peer.addr + max_size, peer.key, NULL)) == -FI_EAGAIN) {
          struct fi_cq_data_entry e[16];
          ssize_t k = fi_cq_read(cq, e, 16);
          for (ssize_t j = 0; j < k; j++)
            if (e[j].flags & FI_REMOTE_CQ_DATA) ++arrivals;
        }
        if (rc) {
          fprintf(stderr, "fi_writedata: %s\n", fi_strerror((int)-rc));
          return 1;
        }
        if (rank == 0) wait_arrival(&arrivals);
      }
      if (b >= 0) times[b] = (now_s() - t0) / per_block / 2 * 1e6;
    }
    qsort(times, blocks, sizeof(double), cmp_double);
    if (rank == 0)
      printf("size %8zu  half-rtt median %8.3f us  best %8.3f us  (%d x %d round trips)\n", size,
             times[blocks / 2], times[0], blocks, per_block);
  }
  unlink(path); /* the peer's file: it has been read */
  fi_close(&ep->fid);
  fi_close(&mr->fid);
  fi_close(&av->fid);
  fi_close(&cq->fid);
  fi_close(&domain->fid);
  fi_close(&fabric->fid);
  fi_freeinfo(all);
  fi_freeinfo(hints);
  rmdir(dir);
  return 0;
}
