// The NCCL side of symmetric memory (src/runtime/gpu/symmetric.rs,
// NcclMemory): where the peers' copies of a symmetric window are, as this
// GPU addresses them. NCCL hands these out only on the device
// (ncclGetLsaPointer), so a one-block kernel writes them into the table
// every kernel of ep reads (peer_bases), once, when a context is made.
#include <nccl_device.h>

#include "ep_abi.h"
#include "ep_device.cuh"

// peer_bases[r] = the window's base on world rank r for the ranks of this
// rank's LSA team (world ranks [first_lsa_rank, first_lsa_rank + lsa_size)),
// 0 for the others, which only the network leg reaches.
extern "C" __global__ void ep_nccl_peer_bases_kernel(const NcclPeerBasesParams p) {
    ep_kernel_start();
    const ncclWindow_t window = static_cast<ncclWindow_t>(p.window);
    for (int r = threadIdx.x; r < p.world; r += blockDim.x) {
        const int lsa = r - p.first_lsa_rank;
        const bool reachable = lsa >= 0 && lsa < p.lsa_size;
        p.peer_bases[r] =
            reachable ? reinterpret_cast<uint64_t>(ncclGetLsaPointer(window, 0, lsa)) : 0;
    }
}
