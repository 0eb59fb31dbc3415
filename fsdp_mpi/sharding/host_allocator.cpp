// torch's CPU allocator for host blocks of 64 KiB and more (built and installed by host_allocator.py): one arena of
// address space, reserved once, where each such block goes to the lowest address it fits (first fit); a freed
// block merges with the free space beside it and stays resident for the next block placed there.
//
// glibc keeps no large block for reuse by itself: it maps each afresh and unmaps it when freed, so every step
// faults in and zeroes the logits and their gradients again; told to keep its heap, it places them among the
// small blocks of every Python object and autograd node, which pin the holes between them, and the heap grows in
// jumps of the largest block (a step's peak up to 1.6x what is live). Kept apart from the small blocks, a step's
// blocks packed by address touch hardly more than the most they hold at once (gpt2-seed, 2 ranks, 8 x 256 tokens
// a rank: 1,728 MB touched for 1,726 in use at most; 4 x 128: 623 for 621): the touched part settles at the
// step's live peak in the first steps, and later steps fault in nothing.
// A block that does not fit in the arena comes from the allocator this one replaced.

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <pthread.h>
#include <sys/mman.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <map>
#include <mutex>
#include <unordered_map>

namespace {

constexpr size_t kGranule = size_t(64) << 10;  // blocks start and end on 64 KiB: page-aligned for madvise
constexpr size_t kHugePage = size_t(2) << 20;
constexpr size_t kNowhere = ~size_t(0);

size_t granules(size_t bytes) { return (bytes + kGranule - 1) / kGranule * kGranule; }

class ArenaAllocator final : public c10::Allocator {
 public:
  ArenaAllocator(c10::Allocator* elsewhere, size_t smallest, char* base, size_t capacity)
      : elsewhere_(elsewhere), smallest_(smallest), base_(base), capacity_(capacity) {
    free_[0] = capacity;
  }

  c10::DataPtr allocate(size_t nbytes) override {
    size_t offset = nbytes < smallest_ ? kNowhere : place(granules(nbytes));
    if (offset == kNowhere) return elsewhere_->allocate(nbytes);
    char* address = base_ + offset;
    c10::profiledCPUMemoryReporter().New(address, nbytes);
    return {address, address, &free_anywhere, c10::Device(c10::DeviceType::CPU)};
  }

  // What torch calls to free a pointer it took raw (raw_allocate: some kernels' scratch), from here or elsewhere.
  c10::DeleterFnPtr raw_deleter() const override { return &free_anywhere; }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    std::memcpy(dest, src, count);
  }

  // The pages of every free range go back to the kernel (a later block there faults in fresh ones).
  void release_free() {
    std::lock_guard<std::mutex> lock(mutex_);
    for (const auto& [start, bytes] : free_) {
      size_t end = std::min(start + bytes, touched_);
      if (start < end) madvise(base_ + start, end - start, MADV_DONTNEED);
    }
    touched_ = in_use_.empty() ? 0 : in_use_.rbegin()->first + in_use_.rbegin()->second;
    most_in_use_ = in_use_bytes_;
  }

  // the arena's address, bytes in use, the most in use at once and bytes touched (the end of the highest block
  // placed: what the arena may hold resident), both since the last release, and blocks that did not fit
  void counters(uint64_t* out) {
    std::lock_guard<std::mutex> lock(mutex_);
    out[0] = reinterpret_cast<uintptr_t>(base_);
    out[1] = in_use_bytes_;
    out[2] = most_in_use_;
    out[3] = touched_;
    out[4] = did_not_fit_;
  }

  std::mutex mutex_;

 private:
  static void free_anywhere(void* address);

  size_t place(size_t bytes) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto fit = std::find_if(free_.begin(), free_.end(), [bytes](const auto& range) { return range.second >= bytes; });
    if (fit == free_.end()) {
      ++did_not_fit_;
      return kNowhere;
    }
    auto [offset, room] = *fit;
    free_.erase(fit);
    if (room > bytes) free_[offset + bytes] = room - bytes;
    in_use_[offset] = bytes;
    in_use_bytes_ += bytes;
    most_in_use_ = std::max(most_in_use_, in_use_bytes_);
    touched_ = std::max(touched_, offset + bytes);
    return offset;
  }

  void release(char* address) {
    c10::profiledCPUMemoryReporter().Delete(address);
    std::lock_guard<std::mutex> lock(mutex_);
    auto block = in_use_.find(static_cast<size_t>(address - base_));
    size_t start = block->first, bytes = block->second;
    in_use_.erase(block);
    in_use_bytes_ -= bytes;
    auto after = free_.lower_bound(start);
    if (after != free_.end() && after->first == start + bytes) {  // merge with the free range above
      bytes += after->second;
      after = free_.erase(after);
    }
    if (after != free_.begin()) {  // and with the one below
      auto before = std::prev(after);
      if (before->first + before->second == start) {
        before->second += bytes;
        return;
      }
    }
    free_[start] = bytes;
  }

  c10::Allocator* elsewhere_;
  size_t smallest_;
  char* base_;
  size_t capacity_;
  std::map<size_t, size_t> free_;    // offset -> bytes, ordered by address
  std::map<size_t, size_t> in_use_;  // offset -> bytes
  size_t in_use_bytes_ = 0, most_in_use_ = 0, touched_ = 0, did_not_fit_ = 0;
};

ArenaAllocator* installed = nullptr;  // never destroyed: tensors are freed until the process ends

void ArenaAllocator::free_anywhere(void* address) {
  char* place = static_cast<char*>(address);
  if (place >= installed->base_ && place < installed->base_ + installed->capacity_) {
    installed->release(place);
  } else {
    installed->elsewhere_->raw_deleter()(address);
  }
}

// A child forked while another thread holds the lock would never get it: fork waits for it.
void lock_before_fork() { installed->mutex_.lock(); }
void unlock_after_fork() { installed->mutex_.unlock(); }

}  // namespace

extern "C" {

// Reserves `capacity` bytes of address space and makes the arena torch's CPU allocator for blocks of `smallest`
// bytes and more. 1 once it is; 0 if torch holds an allocator of a higher priority; -1 if no address space.
int fsdp_mpi_install_host_allocator(uint64_t smallest, uint64_t capacity) {
  if (installed == nullptr) {
    capacity = (capacity + kHugePage - 1) / kHugePage * kHugePage;
    void* reserved = mmap(nullptr, capacity + kHugePage, PROT_READ | PROT_WRITE,
                          MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (reserved == MAP_FAILED) return -1;
    uintptr_t aligned = (reinterpret_cast<uintptr_t>(reserved) + kHugePage - 1) / kHugePage * kHugePage;
    installed = new ArenaAllocator(c10::GetCPUAllocator(), smallest, reinterpret_cast<char*>(aligned), capacity);
    pthread_atfork(lock_before_fork, unlock_after_fork, unlock_after_fork);
    c10::SetCPUAllocator(installed, /*priority=*/100);
  }
  return c10::GetCPUAllocator() == installed;
}

void fsdp_mpi_release_free_host_memory() {
  if (installed != nullptr) installed->release_free();
}

void fsdp_mpi_host_allocator_counters(uint64_t* out) {
  if (installed != nullptr) installed->counters(out);
}

}  // extern "C"
