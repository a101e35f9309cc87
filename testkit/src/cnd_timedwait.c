/*
 * C11's cnd_timedwait, routed through pthread_cond_timedwait, for a process
 * whose wall clock libfaketime skews (testkit's Env::skew_clock).
 *
 * librdkafka waits on its condition variables with C11's cnd_timedwait, until
 * a deadline it computes from the wall clock, which libfaketime moves. glibc's
 * cnd_timedwait calls its pthread code internally, out of libfaketime's reach,
 * so the deadline is waited for by the real clock: five minutes ahead, and
 * every wait of the Kafka client lasts five minutes more. Preloaded before
 * libfaketime, this definition sends the wait through the pthread function
 * libfaketime does translate. glibc's cnd_t and mtx_t wrap pthread's types.
 */
#include <errno.h>
#include <pthread.h>
#include <threads.h>

int cnd_timedwait(cnd_t *restrict cond, mtx_t *restrict mutex,
                  const struct timespec *restrict deadline) {
    int r = pthread_cond_timedwait((pthread_cond_t *)cond,
                                   (pthread_mutex_t *)mutex, deadline);
    if (r == 0)
        return thrd_success;
    return r == ETIMEDOUT ? thrd_timedout : thrd_error;
}
