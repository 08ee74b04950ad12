// A guarded graph: run `guard`, then `body` only if the byte the guard wrote is non-zero.
//
// CUDA conditional nodes (CUDA 12.4+): the guard's graph runs as a child node, a one-thread
// kernel reads its flag and sets the IF node's condition, and the body's graph is a child of the
// IF node's body. Nothing in the body is launched when the flag is zero. The kernel also counts
// the launches and writes (count << 1 | flag) into pinned host memory, so the host learns the
// outcome of its n-th launch as soon as the guard has run, without waiting for the body.
#include <cuda_runtime.h>

namespace {

__global__ void set_condition(cudaGraphConditionalHandle handle, const unsigned char* flag, unsigned int* count,
                              volatile unsigned int* mirror) {
    const unsigned int value = *flag != 0;
    const unsigned int n = *count + 1;
    *count = n;
    cudaGraphSetConditional(handle, value);
    *mirror = (n << 1) | value;
    __threadfence_system();
}

cudaError_t add_node(cudaGraphNode_t* node, cudaGraph_t graph, const cudaGraphNode_t* deps, size_t n,
                     cudaGraphNodeParams* params) {
#if CUDART_VERSION >= 13000
    return cudaGraphAddNode(node, graph, deps, nullptr, n, params);
#else
    return cudaGraphAddNode(node, graph, deps, n, params);
#endif
}

}  // namespace

#define CHECK(call)                          \
    do {                                     \
        cudaError_t err_ = (call);           \
        if (err_ != cudaSuccess) {           \
            if (outer) cudaGraphDestroy(outer); \
            return static_cast<int>(err_);   \
        }                                    \
    } while (0)

// Builds and instantiates `if (*flag) body` after `guard`. `count` is a device uint32 (the launches
// so far), `mirror` a pinned host uint32 that receives (count << 1 | flag) at each launch.
// Returns a cudaError_t value (0: success).
extern "C" int flashrt_guarded_graph(void* guard, void* body, const void* flag, void* count, void* mirror,
                                     void** exec_out) {
    cudaGraph_t outer = nullptr;
    CHECK(cudaGraphCreate(&outer, 0));
    cudaGraphNode_t guard_node, set_node, if_node, body_node;
    CHECK(cudaGraphAddChildGraphNode(&guard_node, outer, nullptr, 0, static_cast<cudaGraph_t>(guard)));

    cudaGraphConditionalHandle handle;
    CHECK(cudaGraphConditionalHandleCreate(&handle, outer, 0, 0));
    const unsigned char* flag_ptr = static_cast<const unsigned char*>(flag);
    unsigned int* count_ptr = static_cast<unsigned int*>(count);
    unsigned int* mirror_ptr = nullptr;
    CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&mirror_ptr), mirror, 0));
    void* args[] = {&handle, &flag_ptr, &count_ptr, &mirror_ptr};
    cudaKernelNodeParams kernel = {};
    kernel.func = reinterpret_cast<void*>(set_condition);
    kernel.gridDim = dim3(1);
    kernel.blockDim = dim3(1);
    kernel.kernelParams = args;
    CHECK(cudaGraphAddKernelNode(&set_node, outer, &guard_node, 1, &kernel));

    cudaGraphNodeParams cond = {};
    cond.type = cudaGraphNodeTypeConditional;
    cond.conditional.handle = handle;
    cond.conditional.type = cudaGraphCondTypeIf;
    cond.conditional.size = 1;
    CHECK(add_node(&if_node, outer, &set_node, 1, &cond));
    CHECK(cudaGraphAddChildGraphNode(&body_node, cond.conditional.phGraph_out[0], nullptr, 0,
                                     static_cast<cudaGraph_t>(body)));

    cudaGraphExec_t exec = nullptr;
    CHECK(cudaGraphInstantiate(&exec, outer, 0));
    cudaGraphDestroy(outer);  // the executable keeps what it needs
    *exec_out = exec;
    return 0;
}

extern "C" int flashrt_graph_launch(void* exec, void* stream) {
    return static_cast<int>(cudaGraphLaunch(static_cast<cudaGraphExec_t>(exec), static_cast<cudaStream_t>(stream)));
}

extern "C" int flashrt_graph_exec_destroy(void* exec) {
    return static_cast<int>(cudaGraphExecDestroy(static_cast<cudaGraphExec_t>(exec)));
}
