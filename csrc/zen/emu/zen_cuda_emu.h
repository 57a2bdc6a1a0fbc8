// zen_ds CUDA emulation: runs the kernels of zen_ops_cuda_kernels.cuh on the CPU, for tests only.
//
// A launch runs its grid's blocks in turn, on the OS thread that launches. A block's threads are
// fibers (user-space contexts, each with its own stack) that this thread runs one at a time: a
// fiber runs until it waits in __syncthreads or a warp collective, or returns, then the next ready
// one runs. __syncthreads is a barrier over the block's live threads (a thread that returned no
// longer counts, as on the GPU), a warp collective (__any_sync, __ballot_sync, __match_any_sync,
// __shfl_up_sync, __syncwarp) waits for every lane its mask names, dynamic shared memory is one
// buffer per block filled with garbage at block start, atomics are std::atomic_ref operations.
//
// Since fibers take turns, the code between two barriers of one thread runs without interleaving
// with other threads: a race shows as a dependence on the order the threads run in. That order
// varies: a block's threads start, and resume after every barrier and warp collective, in
// ascending thread order, descending, or a seeded permutation, chosen per block in turn (so the
// blocks of one launch differ). A kernel whose result depends on the order between barriers gives
// different results from one block to the next. Finer interleavings (two threads inside one
// read-modify-write) occur only as the fault "nonatomic" below models them.
//
// Misuse the GPU would turn into a hang or undefined behaviour raises instead: a deadlock (every
// live thread of a block waiting, e.g. __syncthreads in divergent code), a warp collective whose
// lanes disagree on the mask or one of whose lanes has exited, too much shared memory, too big a
// block. The error names the kernel. A warp runs one collective at a time (the kernels use full
// masks; concurrent collectives of disjoint sub-warp groups are reported as divergent). A C++
// exception in a thread (never let across a fiber's boundary) fails the launch the same way: the
// block's other threads unwind from where they wait, and the launch raises.
//
// Fault injection (set_fault("nonatomic")): atomic read-modify-writes lose their atomicity. Each
// thread's RMWs read memory as it was at the block's last barrier (plus the thread's own earlier
// RMWs) and are written back when the next __syncthreads completes, or when the block ends, in
// thread order:
// the schedule a warp executing a plain read-then-write in lockstep produces. A test proves with it
// that its inputs contend, i.e. that a kernel missing an atomic would be caught.
// set_fault("warp_prefix_skips_warp0") and set_fault("scan_off_by_one") turn on the kernels'
// mutation points (an off-by-one in the partition's per-warp prefix, one in the block scan's first
// shuffle step; see ZEN_MUTATION_* in the kernels header) without a second build.
//
// Several OS threads may launch at once: each has its own fibers; only the launch counts, the
// fault and the count of blocks run (which picks each block's order) are shared, under a mutex.
#pragma once

#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include <signal.h>
#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline

struct uint3 {
    unsigned int x = 0, y = 0, z = 0;
};
using dim3 = uint3;
struct alignas(8) uint2 {
    unsigned int x, y;
};
struct alignas(16) uint4 {
    unsigned int x, y, z, w;
};

// The built-in variables: per OS thread, set by the scheduler for the fiber it resumes.
inline thread_local uint3 threadIdx;
inline thread_local uint3 blockIdx;
inline thread_local dim3 blockDim;
inline thread_local dim3 gridDim;

namespace zen_emu {

constexpr size_t kMaxSharedBytes = 48 * 1024;  // dynamic shared memory without an opt-in
constexpr int kMaxBlockThreads = 1024;

enum class Fault { none, nonatomic, warp_prefix_skips_warp0, scan_off_by_one };

// Unwinds a thread whose block was aborted by another thread's error.
struct Aborted {
};

// ------------------------------------------------------------------ fibers

// A fiber's stack: reserved, committed page by page as it is touched (the kernels use a few KiB;
// a GPU thread gets 1 KiB by default), above an inaccessible guard region so that an overflow
// faults (see on_segv) instead of overwriting another fiber's stack. The guard is 16 pages: a
// frame larger than one page could step over a single guard page.
constexpr size_t kStackBytes = 256 * 1024;
constexpr size_t kGuardBytes = 64 * 1024;

class Stack {
   public:
    Stack()
    {
        void* p = mmap(nullptr, kGuardBytes + kStackBytes, PROT_READ | PROT_WRITE,
                       MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_STACK, -1, 0);
        TORCH_CHECK(p != MAP_FAILED, "zen_ds emulation: cannot map a fiber stack");
        base_ = static_cast<char*>(p);
        if (mprotect(base_, kGuardBytes, PROT_NONE) != 0) {
            munmap(base_, kGuardBytes + kStackBytes);
            TORCH_CHECK(false, "zen_ds emulation: cannot protect a fiber stack's guard");
        }
    }
    ~Stack() { munmap(base_, kGuardBytes + kStackBytes); }
    Stack(const Stack&) = delete;
    Stack& operator=(const Stack&) = delete;

    char* bottom() const { return base_ + kGuardBytes; }
    char* top() const { return base_ + kGuardBytes + kStackBytes; }
    bool in_guard(const void* address) const
    {
        const uintptr_t a = reinterpret_cast<uintptr_t>(address);
        return a >= reinterpret_cast<uintptr_t>(base_) && a < reinterpret_cast<uintptr_t>(bottom());
    }

   private:
    char* base_;
};

// The context switch. On x86-64 a hand-written one: swapcontext saves and restores the signal
// mask, a system call per switch (test_cuda_emulated.py took 15-18 CPU-s with it, 11-12 without).
// Define ZEN_EMU_UCONTEXT to use ucontext anyway (other architectures always do).
#if defined(__x86_64__) && !defined(ZEN_EMU_UCONTEXT)
#define ZEN_EMU_ASM_SWITCH 1
// zen_emu_switch(save, load): pushes the callee-saved registers (System V ABI: rbx, rbp, r12-r15,
// the SSE and x87 control words), stores the stack pointer in *save, continues on stack `load`.
// zen_emu_fiber_start: a new fiber's first return address; calls r13(r12), never returns; the
// outermost frame for an unwinder (a backtrace taken in a fiber, e.g. by c10::Error, ends there).
// Weak and hidden: one copy however many translation units include this header.
extern "C" void zen_emu_switch(void** save, void* load);
extern "C" void zen_emu_fiber_start();
asm(R"(
    .pushsection .text
    .weak zen_emu_switch
    .hidden zen_emu_switch
    .type zen_emu_switch, @function
zen_emu_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    subq $8, %rsp
    stmxcsr (%rsp)
    fnstcw 4(%rsp)
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    ldmxcsr (%rsp)
    fldcw 4(%rsp)
    addq $8, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size zen_emu_switch, .-zen_emu_switch
    .weak zen_emu_fiber_start
    .hidden zen_emu_fiber_start
    .type zen_emu_fiber_start, @function
zen_emu_fiber_start:
    .cfi_startproc
    .cfi_undefined rip
    movq %r12, %rdi
    callq *%r13
    ud2
    .cfi_endproc
    .size zen_emu_fiber_start, .-zen_emu_fiber_start
    .popsection
)");
#else
#define ZEN_EMU_ASM_SWITCH 0
#endif

struct FiberContext {
#if ZEN_EMU_ASM_SWITCH
    void* sp = nullptr;
#else
    ucontext_t uc;
#endif
};

inline void switch_context(FiberContext& from, FiberContext& to)
{
#if ZEN_EMU_ASM_SWITCH
    zen_emu_switch(&from.sp, to.sp);
#else
    swapcontext(&from.uc, &to.uc);
#endif
}

#if !ZEN_EMU_ASM_SWITCH
// makecontext passes ints: the argument travels as two halves.
template <void (*Entry)(void*)>
void ucontext_start(unsigned int high, unsigned int low)
{
    Entry(reinterpret_cast<void*>(uintptr_t(high) << 32 | low));
}
#endif

// Prepares `context` to call Entry(arg) on `stack` when first switched to; Entry never returns.
template <void (*Entry)(void*)>
void make_context(FiberContext& context, const Stack& stack, void* arg)
{
#if ZEN_EMU_ASM_SWITCH
    // The frame zen_emu_switch pops: control words, r15, r14, r13 = Entry, r12 = arg, rbx, rbp,
    // return address; 16-byte aligned at zen_emu_fiber_start's call, as the ABI wants.
    const uintptr_t top = reinterpret_cast<uintptr_t>(stack.top()) & ~uintptr_t(15);
    uint64_t* frame = reinterpret_cast<uint64_t*>(top - 80);
    uint32_t control[2] = {0, 0};
    asm volatile("stmxcsr %0\n\tfnstcw %1" : "=m"(control[0]), "=m"(control[1]));
    control[1] &= 0xffffu;
    std::memcpy(&frame[0], control, 8);
    frame[1] = frame[2] = 0;
    frame[3] = reinterpret_cast<uint64_t>(Entry);
    frame[4] = reinterpret_cast<uint64_t>(arg);
    frame[5] = frame[6] = 0;
    frame[7] = reinterpret_cast<uint64_t>(&zen_emu_fiber_start);
    context.sp = frame;
#else
    TORCH_CHECK(getcontext(&context.uc) == 0, "zen_emu: getcontext failed");
    context.uc.uc_stack.ss_sp = stack.bottom();
    context.uc.uc_stack.ss_size = kStackBytes;
    context.uc.uc_link = nullptr;
    const uintptr_t a = reinterpret_cast<uintptr_t>(arg);
    makecontext(&context.uc, reinterpret_cast<void (*)()>(&ucontext_start<Entry>), 2,
                static_cast<unsigned int>(a >> 32), static_cast<unsigned int>(a & 0xffffffffu));
#endif
}

class Block;
inline thread_local Block* current_block = nullptr;
inline thread_local int current_thread = 0;  // flat thread index inside the block

// The fibers that play a block's threads on one OS thread: created as the largest block so far
// needs them and reused by every launch from that thread (a fiber loops over the blocks it
// plays). The scheduler is the OS thread's own context.
class Executor {
   public:
    static Executor& mine()
    {
        static thread_local Executor executor;
        return executor;
    }

    Executor();
    ~Executor();
    Executor(const Executor&) = delete;
    Executor& operator=(const Executor&) = delete;

    // Runs block.run_thread(t) for t in [0, threads) in the fibers, one at a time in the order the
    // block's scheduler picks; returns when every thread returned.
    void run(Block& block, int threads, const char* kernel);

    // In the SIGSEGV handler: one line on stderr if `address` is in a fiber's guard.
    void report_overflow(const void* address) const;

    // In fiber t: back to the scheduler; returns when the scheduler resumes t.
    void suspend(int t) { switch_context(fibers_[t]->context, scheduler_); }

    // In the scheduler: runs fiber t until it suspends or finishes.
    void resume(int t)
    {
        threadIdx = uint3{static_cast<unsigned int>(t), 0, 0};
        current_thread = t;
        switch_context(scheduler_, fibers_[t]->context);
    }

    bool busy() const { return block_ != nullptr; }

   private:
    struct Fiber {
        Stack stack;
        FiberContext context;
        Executor* executor;
        int index;
    };

    static void fiber_main(void* arg);

    std::vector<std::unique_ptr<Fiber>> fibers_;
    FiberContext scheduler_;
    Block* block_ = nullptr;
    const char* kernel_ = "";
    std::unique_ptr<char[]> signal_stack_;  // ours, when the thread had none
};

// The executor running a block on this OS thread, for the SIGSEGV handler.
inline thread_local Executor* running_executor = nullptr;

// One pending plain read-modify-write (fault "nonatomic"): its address, width and new value.
struct PendingWrite {
    void* address;
    size_t bytes;
    uint64_t value;
};

// A block's synchronisation and its scheduler. Everything runs on one OS thread, so no locks: a
// fiber changes the state, then suspends to the scheduler, which resumes the ready fibers.
class Block {
   public:
    Block(int threads, size_t shared_bytes, Fault fault, void (*body)(void*), void* context)
        : threads_(threads), shared_(shared_bytes + 16), fault_(fault), body_(body),
          context_(context), warps_((threads + 31) / 32), pending_(threads), state_(threads),
          order_(threads), ready_(threads)
    {
    }

    // Called by the launcher, with no fiber running, before each block. `schedule` picks the
    // order of the block's threads: ascending, descending, or a permutation seeded by it.
    void reset(uint64_t schedule)
    {
        live_ = threads_;
        arrived_ = 0;
        for (size_t w = 0; w < warps_.size(); ++w) {
            Warp& warp = warps_[w];
            warp.arrived = warp.mask = 0;
            warp.what = nullptr;
            const int lanes = std::min(32, threads_ - static_cast<int>(w) * 32);
            warp.exited = lanes == 32 ? 0u : ~((1u << lanes) - 1u);  // lanes that do not exist
        }
        std::memset(shared_.data(), 0xA5, shared_.size());  // shared memory starts as garbage
        for (int t = 0; t < threads_; ++t) order_[t] = t;
        for (int l = 0; l < 32; ++l) lane_order_[l] = l;
        if (schedule % 3 == 1) {
            std::reverse(order_.begin(), order_.end());
            std::reverse(std::begin(lane_order_), std::end(lane_order_));
        } else if (schedule % 3 == 2) {
            uint64_t seed = schedule;
            shuffle(order_.data(), threads_, seed);
            shuffle(lane_order_, 32, seed);
        }
        head_ = count_ = 0;
        for (int t : order_) make_ready(t);
    }

    void* shared() { return align16(shared_.data()); }
    Fault fault() const { return fault_; }
    bool failed() const { return !error_.empty(); }
    const std::string& error() const { return error_; }

    // The scheduler: resumes ready fibers until every thread returned. When none is ready but
    // some live, they all wait: a deadlock. After an error the waiting fibers resume to unwind.
    void schedule(Executor& executor) noexcept
    {
        for (;;) {
            while (count_ > 0) {
                const int t = ready_[head_];
                head_ = head_ + 1 == threads_ ? 0 : head_ + 1;
                --count_;
                executor.resume(t);
                if (failed()) wake_all();
            }
            if (live_ == 0) return;
            set_error(std::string("deadlock: every live thread of the block waits (last: ") +
                      last_event_ + "); __syncthreads or a warp collective in divergent code?");
            wake_all();
        }
    }

    // Thread t's whole life in one block, in its fiber: no exception leaves it.
    void run_thread(Executor& executor, int t) noexcept
    {
        executor_ = &executor;
        if (!failed()) {
            try {
                body_(context_);
            } catch (const Aborted&) {
            } catch (const std::exception& e) {
                set_error(e.what());
            } catch (...) {
                set_error("a C++ exception that is not a std::exception");
            }
        }
        exit_thread(t);
    }

    void syncthreads(int thread)
    {
        throw_if_aborted();
        state_[thread] = State::barrier;
        if (++arrived_ == live_) release_barrier();
        else last_event_ = "__syncthreads";
        executor_->suspend(thread);
        throw_if_aborted();
    }

    // Warp collective over the lanes in `mask`: every lane contributes `value`; every lane gets all
    // lanes' values in its `out` (indexed by lane).
    void warp_exchange(int thread, const char* what, uint32_t mask, uint64_t value, uint64_t* out)
    {
        throw_if_aborted();
        Warp& warp = warps_[thread / 32];
        const int lane = thread % 32;
        const uint32_t lane_bit = 1u << lane;
        if (!(mask & lane_bit)) abort(std::string(what) + ": the calling lane is not in its mask");
        if (mask & warp.exited)
            abort(std::string(what) + ": a lane named in the mask has exited or does not exist");
        if (warp.arrived == 0) {
            warp.mask = mask;
            warp.what = what;
        } else if (warp.mask != mask || std::strcmp(warp.what, what) != 0) {
            abort(std::string("divergent warp collective: ") + what + " with mask " +
                  std::to_string(mask) + " while other lanes wait in " + warp.what + " with mask " +
                  std::to_string(warp.mask));
        }
        warp.values[lane] = value;
        warp.out[lane] = out;
        warp.arrived |= lane_bit;
        state_[thread] = State::warp;
        if (warp.arrived == mask) {
            warp.arrived = 0;
            const int first = thread - lane;
            for (int l : lane_order_) {
                if (!(mask >> l & 1u)) continue;
                std::copy(std::begin(warp.values), std::end(warp.values), warp.out[l]);
                make_ready(first + l);
            }
        } else {
            last_event_ = what;
        }
        executor_->suspend(thread);
        throw_if_aborted();
    }

    // Fault "nonatomic": the RMW reads the thread's own pending value, else memory.
    template <typename T, typename Op>
    T plain_rmw(int thread, T* address, Op op)
    {
        std::vector<PendingWrite>& mine = pending_[thread];
        for (auto it = mine.rbegin(); it != mine.rend(); ++it) {
            if (it->address == address) {
                T old;
                std::memcpy(&old, &it->value, sizeof(T));
                const T updated = op(old);
                std::memcpy(&it->value, &updated, sizeof(T));
                return old;
            }
        }
        const T old = std::atomic_ref<T>(*address).load(std::memory_order_relaxed);
        PendingWrite write{address, sizeof(T), 0};
        const T updated = op(old);
        std::memcpy(&write.value, &updated, sizeof(T));
        mine.push_back(write);
        return old;
    }

    // Called by the launcher when the block's threads are all done.
    void flush_all()
    {
        for (int t = 0; t < threads_; ++t) flush(t);
    }

   private:
    enum class State : uint8_t { ready, barrier, warp, done };

    struct Warp {
        uint32_t arrived = 0;  // lanes waiting in the current collective
        uint32_t mask = 0;
        uint32_t exited = 0;
        const char* what = nullptr;  // the current collective (a literal)
        uint64_t values[32] = {};
        uint64_t* out[32] = {};  // each waiting lane's result buffer, on its fiber's stack
    };

    static void* align16(unsigned char* p)
    {
        return reinterpret_cast<void*>((reinterpret_cast<uintptr_t>(p) + 15) & ~uintptr_t(15));
    }

    // splitmix64 steps: a permutation per block, reproducible from `schedule`.
    static void shuffle(int* items, int n, uint64_t& seed)
    {
        for (int i = n - 1; i > 0; --i) {
            uint64_t z = (seed += 0x9E3779B97F4A7C15ull);
            z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
            z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
            std::swap(items[i], items[(z ^ (z >> 31)) % uint64_t(i + 1)]);
        }
    }

    void make_ready(int t)
    {
        state_[t] = State::ready;
        int tail = head_ + count_;
        if (tail >= threads_) tail -= threads_;
        ready_[tail] = t;
        ++count_;
    }

    // The block failed: every waiting fiber resumes, finds the error and unwinds.
    void wake_all()
    {
        for (int t : order_)
            if (state_[t] == State::barrier || state_[t] == State::warp) make_ready(t);
    }

    void throw_if_aborted()
    {
        if (!error_.empty()) throw Aborted{};
    }

    void set_error(const std::string& why)
    {
        if (error_.empty()) error_ = why;
    }

    [[noreturn]] void abort(const std::string& why)
    {
        set_error(why);
        throw Aborted{};
    }

    // Every waiting thread (the completing one included) resumes, in the block's order.
    void release_barrier()
    {
        for (int t = 0; t < threads_; ++t) flush(t);  // fault "nonatomic" only
        arrived_ = 0;
        for (int t : order_)
            if (state_[t] == State::barrier) make_ready(t);
    }

    // The thread returned from the kernel (or unwound).
    void exit_thread(int thread)
    {
        --live_;
        state_[thread] = State::done;
        last_event_ = "exit";
        Warp& warp = warps_[thread / 32];
        const uint32_t lane_bit = 1u << (thread % 32);
        warp.exited |= lane_bit;
        if (warp.arrived != 0 && (warp.mask & lane_bit))
            set_error(std::string("lane ") + std::to_string(thread % 32) + " of warp " +
                      std::to_string(thread / 32) + " exited while its warp waits in " + warp.what);
        if (arrived_ > 0 && arrived_ == live_) release_barrier();
    }

    void flush(int thread)
    {
        for (const PendingWrite& write : pending_[thread])
            std::memcpy(write.address, &write.value, write.bytes);
        pending_[thread].clear();
    }

    const int threads_;
    std::vector<unsigned char> shared_;
    const Fault fault_;
    void (*const body_)(void*);  // the kernel call, run by every thread
    void* const context_;
    Executor* executor_ = nullptr;
    std::vector<Warp> warps_;
    std::vector<std::vector<PendingWrite>> pending_;
    std::vector<State> state_;
    std::vector<int> order_;  // the block's thread order: start, and resumption after a barrier
    int lane_order_[32];      // the same for a warp's lanes after a collective
    std::vector<int> ready_;  // ring buffer of the ready fibers, in the order they resume
    int head_ = 0;
    int count_ = 0;
    int live_ = 0;
    int arrived_ = 0;  // threads waiting in (or arriving at) the current __syncthreads
    const char* last_event_ = "exit";  // the last wait or exit, for the deadlock message
    std::string error_;
};

inline void Executor::fiber_main(void* arg)
{
    Fiber& fiber = *static_cast<Fiber*>(arg);
    for (;;) {  // one iteration per block; nothing on this frame needs destroying
        fiber.executor->block_->run_thread(*fiber.executor, fiber.index);
        fiber.executor->suspend(fiber.index);
    }
}

inline void Executor::run(Block& block, int threads, const char* kernel)
{
    TORCH_CHECK(block_ == nullptr, "zen_ds emulation: a launch from inside a kernel");
    while (static_cast<int>(fibers_.size()) < threads) {
        auto fiber = std::make_unique<Fiber>();
        fiber->executor = this;
        fiber->index = static_cast<int>(fibers_.size());
        make_context<&Executor::fiber_main>(fiber->context, fiber->stack, fiber.get());
        fibers_.push_back(std::move(fiber));
    }
    block_ = &block;
    kernel_ = kernel;
    running_executor = this;
    block.schedule(*this);
    running_executor = nullptr;
    block_ = nullptr;
}

// ------------------------------------------------------------------ stack overflow

// A fiber that overflows its stack faults in the guard. The handler runs on an alternate signal
// stack (the fiber's is full), writes which kernel and thread overflowed, puts back the handler
// it replaced and returns: the fault repeats under that one (Python's faulthandler, or the
// default), and the process dies as it would have. A fiber cannot be unwound from a signal
// handler, so there is no recovering; the point is the message.
inline struct sigaction& previous_segv()
{
    static struct sigaction previous;
    return previous;
}

inline void on_segv(int, siginfo_t* info, void*)
{
    if (running_executor != nullptr) running_executor->report_overflow(info->si_addr);
    sigaction(SIGSEGV, &previous_segv(), nullptr);
}

inline Executor::Executor()
{
    static std::once_flag installed;
    std::call_once(installed, [] {
        struct sigaction action {};
        action.sa_sigaction = &on_segv;
        action.sa_flags = SA_SIGINFO | SA_ONSTACK;
        sigemptyset(&action.sa_mask);
        sigaction(SIGSEGV, &action, &previous_segv());
    });
    stack_t current{};
    if (sigaltstack(nullptr, &current) == 0 && (current.ss_flags & SS_DISABLE)) {
        constexpr size_t bytes = 64 * 1024;
        signal_stack_.reset(new char[bytes]);
        stack_t mine{};
        mine.ss_sp = signal_stack_.get();
        mine.ss_size = bytes;
        if (sigaltstack(&mine, nullptr) != 0) signal_stack_.reset();
    }
}

inline Executor::~Executor()
{
    stack_t current{};
    if (signal_stack_ && sigaltstack(nullptr, &current) == 0 &&
        current.ss_sp == signal_stack_.get()) {
        stack_t off{};
        off.ss_flags = SS_DISABLE;
        sigaltstack(&off, nullptr);
    }
}

inline void Executor::report_overflow(const void* address) const
{
    bool ours = false;
    for (const auto& fiber : fibers_) ours = ours || fiber->stack.in_guard(address);
    if (!ours) return;
    // async-signal-safe: no allocation, no stdio
    char line[512];
    size_t n = 0;
    auto put = [&](const char* s) {
        while (*s && n < sizeof(line) - 1) line[n++] = *s++;
    };
    auto put_number = [&](uint64_t v) {
        char digits[24];
        int d = 0;
        do digits[d++] = static_cast<char>('0' + v % 10); while ((v /= 10) != 0);
        while (d > 0 && n < sizeof(line) - 1) line[n++] = digits[--d];
    };
    put("zen_ds emulation: kernel ");
    put(kernel_);
    put(": thread ");
    put_number(threadIdx.x);
    put(" of block ");
    put_number(blockIdx.x);
    put(" overflowed its fiber stack of ");
    put_number(kStackBytes / 1024);
    put(" KiB\n");
    ssize_t written = write(STDERR_FILENO, line, n);
    (void)written;
}

// ------------------------------------------------------------------ process-wide state

struct Registry {
    std::mutex mutex;
    std::map<std::string, int64_t> launches;  // kernel name -> launches
    Fault fault = Fault::none;
    uint64_t blocks = 0;  // blocks run: picks each block's thread order
};

inline Registry& registry()
{
    static Registry instance;
    return instance;
}

inline void set_fault(const std::string& name)
{
    std::lock_guard<std::mutex> lock(registry().mutex);
    if (name == "none") registry().fault = Fault::none;
    else if (name == "nonatomic") registry().fault = Fault::nonatomic;
    else if (name == "warp_prefix_skips_warp0") registry().fault = Fault::warp_prefix_skips_warp0;
    else if (name == "scan_off_by_one") registry().fault = Fault::scan_off_by_one;
    else throw std::invalid_argument("zen_ds emulation: unknown fault '" + name +
                                     "' (none, nonatomic, warp_prefix_skips_warp0, scan_off_by_one)");
}

inline std::map<std::string, int64_t> launch_counts()
{
    std::lock_guard<std::mutex> lock(registry().mutex);
    return registry().launches;
}

inline void reset_launch_counts()
{
    std::lock_guard<std::mutex> lock(registry().mutex);
    registry().launches.clear();
}

// ------------------------------------------------------------------ launch

// Runs body() as every thread of every block of the grid; blocks in turn, threads as fibers.
template <typename Body>
void run_grid(const char* name, int64_t grid, int64_t block, size_t shared_bytes, Body body)
{
    TORCH_CHECK(grid >= 1 && grid <= INT32_MAX, "zen_ds emulation: ", name, ": grid of ", grid,
                " blocks");
    TORCH_CHECK(block >= 1 && block <= kMaxBlockThreads, "zen_ds emulation: ", name, ": block of ",
                block, " threads");
    TORCH_CHECK(shared_bytes <= kMaxSharedBytes, "zen_ds emulation: ", name, " asks ", shared_bytes,
                " bytes of dynamic shared memory; a launch gets ", kMaxSharedBytes,
                " without cudaFuncSetAttribute");
    Fault fault;
    uint64_t schedule;
    {
        std::lock_guard<std::mutex> lock(registry().mutex);
        ++registry().launches[name];
        fault = registry().fault;
        schedule = registry().blocks;
        registry().blocks += static_cast<uint64_t>(grid);
    }
    const int threads = static_cast<int>(block);
    Block state(threads, shared_bytes, fault, [](void* b) { (*static_cast<Body*>(b))(); }, &body);
    Executor& executor = Executor::mine();
    TORCH_CHECK(!executor.busy(), "zen_ds emulation: kernel ", name, " launched from a kernel");
    blockDim = dim3{static_cast<unsigned int>(threads), 1, 1};
    gridDim = dim3{static_cast<unsigned int>(grid), 1, 1};
    struct Current {  // cleared however the launch ends
        explicit Current(Block* block) { current_block = block; }
        ~Current() { current_block = nullptr; }
    } current(&state);
    for (int64_t b = 0; b < grid && !state.failed(); ++b) {
        blockIdx = uint3{static_cast<unsigned int>(b), 0, 0};
        state.reset(schedule + static_cast<uint64_t>(b));
        executor.run(state, threads, name);
        state.flush_all();
    }
    TORCH_CHECK(!state.failed(), "zen_ds emulation: kernel ", name, ": ", state.error());
}

// ZEN_LAUNCH(grid, block, shmem, stream, kernel)(args...): arguments are converted to the
// kernel's parameter types and copied, as a real launch does.
template <typename... Params>
struct Launch {
    const char* name;
    int64_t grid;
    int64_t block;
    size_t shared_bytes;
    void (*kernel)(Params...);

    template <typename... Args>
    void operator()(Args&&... args) const
    {
        static_assert(sizeof...(Args) == sizeof...(Params), "kernel argument count");
        std::tuple<std::decay_t<Params>...> copies(static_cast<std::decay_t<Params>>(args)...);
        auto fn = kernel;
        run_grid(name, grid, block, shared_bytes, [&] { std::apply(fn, copies); });
    }
};

template <typename... Params>
Launch<Params...> make_launch(const char* name, int64_t grid, int64_t block, size_t shared_bytes,
                              void (*kernel)(Params...))
{
    return Launch<Params...>{name, grid, block, shared_bytes, kernel};
}

inline Block& block_of_caller()
{
    TORCH_CHECK(current_block != nullptr, "zen_ds emulation: a device function ran outside a kernel");
    return *current_block;
}

}  // namespace zen_emu

// ------------------------------------------------------------------ the CUDA built-ins

inline void __syncthreads() { zen_emu::block_of_caller().syncthreads(zen_emu::current_thread); }

inline void __syncwarp(unsigned int mask = 0xffffffffu)
{
    uint64_t values[32];
    zen_emu::block_of_caller().warp_exchange(zen_emu::current_thread, "__syncwarp", mask, 0, values);
}

inline unsigned int __ballot_sync(unsigned int mask, int predicate)
{
    uint64_t values[32];
    zen_emu::block_of_caller().warp_exchange(zen_emu::current_thread, "__ballot_sync", mask,
                                             predicate != 0, values);
    unsigned int ballot = 0;
    for (int lane = 0; lane < 32; ++lane)
        if ((mask >> lane & 1u) && values[lane]) ballot |= 1u << lane;
    return ballot;
}

inline int __any_sync(unsigned int mask, int predicate) { return __ballot_sync(mask, predicate) != 0; }

inline int __all_sync(unsigned int mask, int predicate) { return __ballot_sync(mask, predicate) == mask; }

template <typename T>
unsigned int __match_any_sync(unsigned int mask, T value)
{
    static_assert(std::is_integral<T>::value && sizeof(T) <= 8, "__match_any_sync takes 32/64-bit ints");
    uint64_t values[32];
    uint64_t mine = 0;
    std::memcpy(&mine, &value, sizeof(T));
    zen_emu::block_of_caller().warp_exchange(zen_emu::current_thread, "__match_any_sync", mask, mine,
                                             values);
    unsigned int peers = 0;
    for (int lane = 0; lane < 32; ++lane)
        if ((mask >> lane & 1u) && values[lane] == mine) peers |= 1u << lane;
    return peers;
}

// var of lane (lane - delta) within each group of `width` lanes; a lane below that keeps its own.
template <typename T>
T __shfl_up_sync(unsigned int mask, T var, unsigned int delta, int width = 32)
{
    static_assert(std::is_trivially_copyable<T>::value && sizeof(T) <= 8, "__shfl_up_sync takes up to 8 bytes");
    uint64_t values[32];
    uint64_t mine = 0;
    std::memcpy(&mine, &var, sizeof(T));
    zen_emu::block_of_caller().warp_exchange(zen_emu::current_thread, "__shfl_up_sync", mask, mine,
                                             values);
    const int lane = zen_emu::current_thread % 32;
    const int source = lane - static_cast<int>(delta);
    if (source < lane / width * width) return var;
    T out;
    std::memcpy(&out, &values[source], sizeof(T));
    return out;
}

inline int __popc(unsigned int x) { return __builtin_popcount(x); }
inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
inline int __ffs(int x) { return __builtin_ffs(x); }
inline int __ffsll(long long x) { return __builtin_ffsll(x); }

namespace zen_emu {

template <typename T, typename Op, typename Atomic>
T rmw(T* address, Op op, Atomic atomic)
{
    Block& block = block_of_caller();
    if (block.fault() == Fault::nonatomic) return block.plain_rmw(current_thread, address, op);
    return atomic(std::atomic_ref<T>(*address));
}

}  // namespace zen_emu

// The kernels' mutation points (zen_ops_cuda_kernels.cuh): wrong only under their faults.
#define ZEN_MUTATION_WARP_PREFIX_FIRST \
    (zen_emu::block_of_caller().fault() == zen_emu::Fault::warp_prefix_skips_warp0 ? 1 : 0)
#define ZEN_MUTATION_SCAN_FIRST_LANE \
    (zen_emu::block_of_caller().fault() == zen_emu::Fault::scan_off_by_one ? 1 : 0)

template <typename T, typename V>
T atomicAdd(T* address, V value)
{
    const T v = static_cast<T>(value);
    return zen_emu::rmw(address, [v](T old) { return static_cast<T>(old + v); },
                        [v](std::atomic_ref<T> a) { return a.fetch_add(v); });
}

template <typename T, typename V>
T atomicOr(T* address, V value)
{
    static_assert(std::is_integral<T>::value, "atomicOr takes an integer");
    const T v = static_cast<T>(value);
    return zen_emu::rmw(address, [v](T old) { return static_cast<T>(old | v); },
                        [v](std::atomic_ref<T> a) { return a.fetch_or(v); });
}

template <typename T, typename V>
T atomicAnd(T* address, V value)
{
    static_assert(std::is_integral<T>::value, "atomicAnd takes an integer");
    const T v = static_cast<T>(value);
    return zen_emu::rmw(address, [v](T old) { return static_cast<T>(old & v); },
                        [v](std::atomic_ref<T> a) { return a.fetch_and(v); });
}

template <typename T, typename V>
T atomicMax(T* address, V value)
{
    const T v = static_cast<T>(value);
    auto cas_max = [v](std::atomic_ref<T> a) {
        T old = a.load();
        while (old < v && !a.compare_exchange_weak(old, v)) {
        }
        return old;
    };
    return zen_emu::rmw(address, [v](T old) { return std::max(old, v); }, cas_max);
}

template <typename T, typename V>
T atomicExch(T* address, V value)
{
    const T v = static_cast<T>(value);
    return zen_emu::rmw(address, [v](T) { return v; }, [v](std::atomic_ref<T> a) { return a.exchange(v); });
}

template <typename T, typename U, typename V>
T atomicCAS(T* address, U compare, V value)
{
    T expected = static_cast<T>(compare);
    const T desired = static_cast<T>(value);
    return zen_emu::rmw(
        address, [expected, desired](T old) { return old == expected ? desired : old; },
        [expected, desired](std::atomic_ref<T> a) mutable {
            a.compare_exchange_strong(expected, desired);
            return expected;
        });
}

// ------------------------------------------------------------------ platform of the kernels header

#define ZEN_LAUNCH(grid, block, shmem, stream, ...) \
    ::zen_emu::make_launch(#__VA_ARGS__, (grid), (block), (shmem), &__VA_ARGS__)
#define ZEN_SHARED_ARRAY(type, name) \
    type* name = static_cast<type*>(::zen_emu::block_of_caller().shared())
#define ZEN_DEVICE_GUARD(tensor) (void)(tensor)
#define ZEN_STREAM() 0
#define ZEN_LAUNCH_CHECK() (void)0
#define ZEN_ON_DEVICE(tensor) (tensor).is_cpu()
using ZenStream = int;
