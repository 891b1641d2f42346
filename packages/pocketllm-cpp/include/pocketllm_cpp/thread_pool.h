// One persistent pool of worker threads, created once. A decode step has a few hundred parallel regions (every
// matmul, every attention), so a region must cost microseconds. Its work is cut into chunks that the threads
// claim as they come, the caller among them: a worker that is descheduled (a busy host, a container's CPU quota)
// or still waking delays nothing it has not claimed, and a region never costs much more than the caller alone
// would take. Waiting threads (a worker for the next region, the caller for chunks under way) spin for a while,
// then yield, then sleep (see Spinner).
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace pocketllm {

// One waiting thread's policy: spin up to its limit (kSpin at most: a region's imbalance, the serial work
// between two regions, the gap between two decode steps), then yield its CPU until kYield, then report that it
// should sleep. The limit halves after a spin that did not see its wait end and grows back after one that did:
// where the threads outnumber the CPUs they get, spins shrink to none and stop taking CPU time from the others.
class Spinner {
public:
    static constexpr std::chrono::microseconds kSpin{200}, kYield{100};
    // True once ready() holds, false when it did not within the spin and yield phases (the caller then sleeps).
    bool wait(const std::function<bool()>& ready);

private:
    std::chrono::steady_clock::duration limit_ = kSpin;
};

class ThreadPool {
public:
    explicit ThreadPool(int num_threads);  // the calling thread is one of them
    ~ThreadPool();
    ThreadPool(const ThreadPool&) = delete;
    ThreadPool& operator=(const ThreadPool&) = delete;

    int size() const { return static_cast<int>(workers_.size()) + 1; }
    // Seconds the caller spent waiting for chunks under way once none was left to claim, and regions run (see
    // Profile).
    double wait_seconds() const { return wait_seconds_; }
    int64_t regions() const { return regions_; }
    // Runs fn(begin, end) over contiguous ranges that cover [0, n), a few per thread, each on whichever thread
    // claims it; returns when all are done. The first exception thrown by any range is rethrown here. Not
    // reentrant: one caller at a time.
    void parallel_for(int64_t n, const std::function<void(int64_t, int64_t)>& fn);
    // Runs fn(i) for each i in [0, n), the threads claiming indices in order as they finish one: for items of
    // uneven cost (attention over sequences of different lengths), given largest first.
    void parallel_each(int64_t n, const std::function<void(int64_t)>& fn);

private:
    void run(int64_t n, int64_t chunks, const std::function<void(int64_t, int64_t)>& fn);
    // Claims and runs chunks of region `generation` until none is left (or that region is over).
    void help(uint32_t generation);
    void work();

    std::vector<std::thread> workers_;
    // The region's work, written by the caller before it publishes the region in claim_, and read by a thread
    // only once it has claimed one of its chunks: the region cannot end before that chunk is done.
    const std::function<void(int64_t, int64_t)>* task_ = nullptr;
    int64_t n_ = 0;
    // The region's generation (bits 32-63), its chunk count (16-31) and its next unclaimed chunk (0-15): a claim
    // is one compare-and-swap, which fails once the region changed.
    std::atomic<uint64_t> claim_{0};
    std::atomic<int64_t> completed_{0};  // chunks of the region done
    std::atomic<int> sleepers_{0};             // workers asleep on wake_
    std::atomic<bool> caller_asleep_{false};  // the caller asleep on done_
    std::atomic<bool> stopping_{false};
    std::mutex mutex_;  // guards sleeping and the first error
    std::condition_variable wake_, done_;
    std::exception_ptr error_;
    Spinner spinner_;  // the caller's
    uint32_t generation_ = 0;
    double wait_seconds_ = 0;
    int64_t regions_ = 0;
};

// The CPUs this process may run on: its affinity mask, capped by its cgroup's CPU bandwidth quota (see
// cgroup_cpu_quota) rounded up; at least 1. The default thread count: a machine's cores overstate what a
// container with a quota, or a process pinned to a few cores, gets.
int available_cpus();
// The CPU quota, in CPUs, of the cgroups this process is in: cgroup v2's cpu.max, or v1's cpu.cfs_quota_us over
// cpu.cfs_period_us, the smallest along each hierarchy (a parent's limit applies to its children); 0 when there is
// none. Reads /proc/self/cgroup, /proc/self/mountinfo and the cgroup files below `root` ("" in use; tests pass a
// directory that mimics them).
double cgroup_cpu_quota(const std::string& root = "");

}  // namespace pocketllm
