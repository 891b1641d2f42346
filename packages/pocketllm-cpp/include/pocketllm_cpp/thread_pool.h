// One persistent pool of worker threads, created once. A decode step has a few hundred parallel regions (every
// matmul, every attention), so a region must cost microseconds: a waiting thread (a worker for the next region,
// the caller for the workers) spins for a while, then yields its CPU, then sleeps on a condition variable (see
// Spinner). The bounds matter when the threads outnumber the CPUs they get (a busy host, a container's CPU
// quota): a thread that spins for one that is descheduled burns the CPU time the other needs.
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

// One waiting thread's policy: spin up to kSpin, then yield its CPU until kYield, then sleep. kSpin is longer than
// a region's imbalance and the serial work between two regions of a step (norms, RoPE), and about the gap between
// two decode steps (sampling, the Python side). Past it, the thread waited for is most likely descheduled: spinning
// on burns the CPU time that thread needs, and the scheduler favours a thread that slept over one that spun. The
// spin adapts: halved after a spin that did not see the wait end (where threads outnumber the CPUs they get,
// every one, so that spins shrink to none), grown back after one that did.
class Spinner {
public:
    static constexpr std::chrono::microseconds kSpin{100}, kYield{200};
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
    // Seconds the caller spent waiting for workers after its own range, and regions run (see Profile).
    double wait_seconds() const { return wait_seconds_; }
    int64_t regions() const { return regions_; }
    // Runs fn(begin, end) over [0, n) split into one contiguous range per thread; returns when all are done.
    // The first exception thrown by any range is rethrown here. Not reentrant: one caller at a time.
    void parallel_for(int64_t n, const std::function<void(int64_t, int64_t)>& fn);
    // Runs fn(i) for each i in [0, n), threads taking the next index as they finish one: for items of uneven
    // cost (attention over sequences of different lengths), given largest first.
    void parallel_each(int64_t n, const std::function<void(int64_t)>& fn);

private:
    void work(int index);
    void run_range(int index);

    std::vector<std::thread> workers_;
    const std::function<void(int64_t, int64_t)>* task_ = nullptr;
    int64_t n_ = 0;
    std::atomic<uint64_t> generation_{0};
    std::atomic<int> pending_{0};
    std::atomic<int> sleepers_{0};         // workers asleep on wake_
    std::atomic<bool> caller_asleep_{false};  // the caller asleep on done_
    std::atomic<bool> stopping_{false};
    std::mutex mutex_;  // guards sleeping and the first error
    std::condition_variable wake_, done_;
    std::exception_ptr error_;
    Spinner spinner_;  // the caller's
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
