/* test_load.c - dlopen(RTLD_NOW) of a tsock library, as ctypes.CDLL does:
 * every symbol must resolve with no NVIDIA driver or other extra library.
 * Usage: test_load LIBRARY [producer]   ("producer": it must have the producer too) */
#define _GNU_SOURCE
#include <dlfcn.h>

#include "test_util.h"

typedef const char *(*status_str_fn)(int);
typedef int (*attach_fn)(const char *, const tsock_reader_options_t *, tsock_reader_t **);
typedef int (*create_fn)(const char *, const tsock_producer_options_t *, tsock_producer_t **);

int main(int argc, char **argv) {
  if (argc < 2) {
    fprintf(stderr, "usage: %s LIBRARY [producer]\n", argv[0]);
    return 2;
  }
  int want_producer = argc > 2 && strcmp(argv[2], "producer") == 0;
  void *lib = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
  if (lib == NULL) {
    fprintf(stderr, "dlopen %s: %s\n", argv[1], dlerror());
    return 1;
  }
  const char *all[] = {"tsock_status_str", "tsock_last_error", "tsock_dtype_size",
                       "tsock_tensor_init", "tsock_reader_options_init", "tsock_reader_attach",
                       "tsock_reader_acquire", "tsock_reader_release",
                       "tsock_reader_payload_range", "tsock_reader_detach",
                       "tsock_reader_register_host", "tsock_batch_dlpack",
                       "tsock_batch_dlpack_cuda", "tsock_batch_dlpack_export",
                       "tsock_dlpack_delete"};
  for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) CHECK(dlsym(lib, all[i]) != NULL);
  const char *producer[] = {"tsock_producer_options_init", "tsock_producer_create",
                            "tsock_producer_reserve", "tsock_producer_publish",
                            "tsock_producer_abort", "tsock_producer_end_epoch",
                            "tsock_producer_wait_readers", "tsock_producer_stats",
                            "tsock_producer_reader_pids",
                            "tsock_producer_close", "tsock_producer_peek"};
  for (size_t i = 0; i < sizeof producer / sizeof producer[0]; i++)
    CHECK((dlsym(lib, producer[i]) != NULL) == want_producer);
  /* Internal helpers stay hidden. */
  CHECK(dlsym(lib, "tsock__fail") == NULL);
  CHECK(dlsym(lib, "tsock__now_ns") == NULL);

  status_str_fn status_str = (status_str_fn)dlsym(lib, "tsock_status_str");
  attach_fn attach = (attach_fn)dlsym(lib, "tsock_reader_attach");
  if (status_str == NULL || attach == NULL) return test_report("test_load");
  CHECK(strcmp(status_str(TSOCK_ENOENT), "no such channel") == 0);
  tsock_reader_t *r = NULL;
  CHECK(attach(test_name("tload", "missing"), NULL, &r) == TSOCK_ENOENT);
  if (want_producer) {
    create_fn create = (create_fn)dlsym(lib, "tsock_producer_create");
    tsock_producer_t *p = NULL;
    CHECK(create != NULL && create("a/b", NULL, &p) == TSOCK_ENAME);
  }
  return test_report("test_load");
}
