// fusedmoe internal: which Workspace slot holds what (CPU modular kernel and runner).
// Slots are independent grow-only buffers; users of one Workspace must not
// reuse a slot that holds something still needed.
#pragma once

namespace fusedmoe::cpu {

enum WorkspaceSlot : int {
  // PrepareFinalize (live from prepare to finalize)
  kWsExpertOffsets = 0,  // i64 [E + 1] (+ E counters for the scatter)
  kWsPermuted,           // f32 [M, H]
  kWsSrcRow,             // i32 [M]
  kWsSlotToRow,          // i32 [T * k]
  kWsExpertOutput,       // f32 [M, H]: Experts output, finalize input
  // Experts (live inside apply)
  kWsIntermediate,   // f32 [M, I]: activation output
  kWsWorkItems,      // work item list
  kWsThreadScratch,  // per-thread GEMM panel + gate/up block
  kWsAmxTiles,       // i64 [E + 1]: first AMX row tile of each expert
  kWsAmxX,           // u16: the routed rows packed into AMX tiles (bf16)
  kWsAmxAct,         // u16: the activations packed into AMX tiles (bf16)
  // Runner
  kWsRouterLogits,   // f32 [T, E + Z]
  kWsTopkIds,        // i32 [T, k]
  kWsTopkWeights,    // f32 [T, k]
  kWsSharedInput,    // f32 [T, H] (bf16-rounded hidden states)
  kWsSharedOffsets,  // i64 [2]
  kWsSharedOutput,   // f32 [T, H]
  kWsSharedGate,     // f32 [T]
  kWsNumSlots
};

}  // namespace fusedmoe::cpu
