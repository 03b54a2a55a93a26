// The NCCL side of symmetric memory (src/runtime/gpu/symmetric.rs,
// NcclMemory): where the peers' copies of a symmetric window are, as this
// GPU addresses them. NCCL hands these out only on the device
// (ncclGetLsaPointer), so a one-block kernel writes them into the table
// every kernel of ep reads (peer_bases), once, when a context is made.
#include <stdint.h>

#include <nccl_device.h>

// peer_bases[r] = the window's base on world rank r for the ranks of this
// rank's LSA team (world ranks [first_lsa_rank, first_lsa_rank + lsa_size)),
// 0 for the others, which only the network leg reaches.
extern "C" __global__ void ep_nccl_peer_bases_kernel(ncclWindow_t window, int first_lsa_rank,
                                                     int lsa_size, int world,
                                                     uint64_t* peer_bases) {
    for (int r = threadIdx.x; r < world; r += blockDim.x) {
        const int lsa = r - first_lsa_rank;
        const bool reachable = lsa >= 0 && lsa < lsa_size;
        peer_bases[r] =
            reachable ? reinterpret_cast<uint64_t>(ncclGetLsaPointer(window, 0, lsa)) : 0;
    }
}
