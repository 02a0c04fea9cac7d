// Faults the kernels detect and what a wait does about them: the CUDA side of
// specdec_kernels/_faults.py (word indices of the device's fault counters,
// checked equal by the tests).
//
// A bounded wait that gives up (its bound reached, or forced by a test)
// adds one to its request's failure flag; the request's last block then
// counts the flag into the op's word of the fault counters, clears it and
// writes the failure outcome (tokens -1, num_accepted 0), and, as on every
// path, puts the workspace back at zero. Once the flag is up the request's
// other waits end at once: the outcome is decided, and each would otherwise
// spin to its own bound. (The waiting block touches the flag only: a
// second pointer live into every wait cost the chain kernels 4-12 bytes of
// spills at their 128-register cap.)
//
// This header includes no torch header.
#pragma once

#include <cstdint>
#include <type_traits>

#include "specdec/common.cuh"

namespace specdec {

// Words of the device's fault counters (int32, _faults.KINDS).
constexpr int kChainWaitGaveUp = 0;
constexpr int kTreeWaitGaveUp = 1;
constexpr int kFaultKinds = 2;

constexpr int64_t kNoFault = -1;  // the role of a launch without a forced give-up

// Where a wait reports giving up.
struct WaitFault {
  int32_t* failed;  // the request's failure flag: the count of its waits that gave up
  bool give_up;     // tests: the block gives up its waits at once
};

// An arrival count no launch makes (issue 35): negative, or `expected` or
// more, when `expected` blocks count in from zero. Block::arrive_last treats
// it as a fault: it raises the request's failure flag (sets its bit 0, so a
// damaged flag never comes back to 0) and takes the damage
// back out of the counter (subtracts the count it saw), so the blocks after
// it count from one and the last of them writes the failure outcome.
template <class Word>
SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE bool arrival_out_of_range(Word before, Word expected) {
  return before < 0 || before >= expected;
}

// `-word` wrapping as the device's atomics do (a damaged word may hold the
// type's smallest value, whose negation overflows: undefined in C++).
template <class Word>
SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE Word wrapping_negative(Word word) {
  using Bits = typename std::make_unsigned<Word>::type;
  return static_cast<Word>(Bits{0} - static_cast<Bits>(word));
}

// A launch's claim of a request's words (kernels/stage_records.py, `claim`):
// the claim word holds 2 * stamp while the first block of the launch resets
// the words, 2 * stamp + 1 once it has; `stamp` is a number the host draws
// per launch, in [2**40, 2**61). Any other value (zero, another launch's,
// damage) is not this launch's, and the first block to see it takes it over.
SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE int64_t claim_resetting(int64_t stamp) { return 2 * stamp; }
SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE int64_t claim_ready(int64_t stamp) { return 2 * stamp + 1; }
SPECDEC_HOST_DEVICE SPECDEC_FORCEINLINE bool claim_is_stale(int64_t seen, int64_t stamp) {
  return (seen >> 1) != stamp;
}

// The last block of a request, after every wait of it: clears the failure
// flag, counts the request as one fault in `errors` (the op's word of the
// fault counters; nullptr: not counted) if any wait gave up, and returns
// whether one did. One a request, not the flag's value: a damaged flag may
// hold anything.
template <class Block>
SPECDEC_HOST_DEVICE bool count_give_ups(const Block& block, int32_t* failed, int32_t* errors) {
  const int32_t gave_up = block.fetch_and_clear(failed);
  if (gave_up != 0 && errors != nullptr) block.add_relaxed(errors, int32_t{1});
  return gave_up != 0;
}

}  // namespace specdec
