// Host-side dispatch shared by the op handlers: matching the attributes to a tile configuration
// of a compiled kernel list (the X-macros of contract/sm90_tiles.generated.h), the error for a
// configuration that was not compiled, and the definition of an op's two handlers (result in a
// fresh buffer, or written into a donated one) from one implementation function.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>

#include "xla/ffi/api/ffi.h"

namespace jax_tma::ffi_util {

template <class Attrs, class = void>
struct HasEpilogue : std::false_type {};
template <class Attrs>
struct HasEpilogue<Attrs, std::void_t<decltype(Attrs::epilogue)>> : std::true_type {};

// Whether attributes with block_m, block_n, stages and cluster_m (and epilogue, where the op
// has that attribute) name `Tile`.
template <class Tile, class Attrs>
bool tile_matches(const Attrs& p) {
  bool match = p.block_m == Tile::kBlockM && p.block_n == Tile::kBlockN &&
               p.stages == Tile::kStages && p.cluster_m == Tile::kClusterM;
  if constexpr (HasEpilogue<Attrs>::value) {
    match = match && p.epilogue == static_cast<int64_t>(Tile::kEpilogue);
  }
  return match;
}

// "block_m=.., block_n=.., stages=.., cluster_m=..": the tile the attributes ask for.
template <class Attrs>
std::string describe_tile(const Attrs& p) {
  return "block_m=" + std::to_string(p.block_m) + ", block_n=" + std::to_string(p.block_n) +
         ", stages=" + std::to_string(p.stages) + ", cluster_m=" + std::to_string(p.cluster_m);
}

// "<op>: no compiled configuration with <tile><more>".
template <class Attrs>
xla::ffi::Error no_configuration(const char* op, const Attrs& p, const std::string& more = "") {
  return xla::ffi::Error::InvalidArgument(std::string(op) + ": no compiled configuration with " +
                                          describe_tile(p) + more);
}

// One compiled kernel of an X-macro list: its tile, and its operand layout and variant (fusion,
// mode, ...) where the op has them.
template <class Tile_, class Layout_ = void, class Variant_ = void>
struct Kernel {
  using Tile = Tile_;
  using Layout = Layout_;
  using Variant = Variant_;
};

// The kernels an X-macro list compiles, each written `Kernel<...>,` and the list closed by
// `void` (the X-macros leave a trailing comma).
template <class... Kernels>
struct KernelList {};

template <class K, class Attrs, class Matches, class Run>
bool try_kernel(const Attrs& p, const Matches& matches, const Run& run, xla::ffi::Error* result) {
  if constexpr (std::is_void_v<K>) {
    return false;
  } else {
    if (!tile_matches<typename K::Tile>(p) || !matches(K{})) return false;
    *result = run(K{});
    return true;
  }
}

// run(kernel) for the first kernel of the list whose tile the attributes name and that
// matches(kernel) accepts (layout, variant); none() when no kernel does.
template <class... Kernels, class Attrs, class Matches, class Run, class None>
xla::ffi::Error dispatch(KernelList<Kernels...>, const Attrs& p, const Matches& matches,
                         const Run& run, const None& none) {
  xla::ffi::Error result;
  if ((try_kernel<Kernels>(p, matches, run, &result) || ...)) return result;
  return none();
}

// An op's implementation function:
//   ffi::Error impl(cudaStream_t, int32_t device, AnyBuffer inputs..., Result<AnyBuffer>
//                   results..., Attrs)
// from whose parameters both handlers' bindings follow.
template <class Fn>
struct Signature;
template <class... Params>
struct Signature<xla::ffi::Error (*)(cudaStream_t, int32_t, Params...)> {
  template <class T>
  using Bare = std::remove_cv_t<std::remove_reference_t<T>>;
  static constexpr size_t kInputs = (0 + ... + std::is_same_v<Bare<Params>, xla::ffi::AnyBuffer>);
  static constexpr size_t kResults =
      (0 + ... + std::is_same_v<Bare<Params>, xla::ffi::Result<xla::ffi::AnyBuffer>>);
  static_assert(kInputs + kResults + 1 == sizeof...(Params),
                "impl takes buffers, results and one attribute struct");
  using Attrs = Bare<std::tuple_element_t<sizeof...(Params) - 1, std::tuple<Params...>>>;
};

template <size_t kArgs, size_t kRets, class Attrs, class Binding>
auto bind_buffers(Binding binding) {
  if constexpr (kArgs > 0) {
    return bind_buffers<kArgs - 1, kRets, Attrs>(
        std::move(binding).template Arg<xla::ffi::AnyBuffer>());
  } else if constexpr (kRets > 0) {
    return bind_buffers<0, kRets - 1, Attrs>(
        std::move(binding).template Ret<xla::ffi::AnyBuffer>());
  } else {
    return std::move(binding).template Attrs<Attrs>();
  }
}

// The launch stream, the device, the impl's inputs, `kAliased` more inputs (the into handler's
// donated results), the impl's results and its attributes (decoded by name).
template <auto kImpl, size_t kAliased>
auto handler_binding() {
  using Sig = Signature<decltype(kImpl)>;
  return bind_buffers<Sig::kInputs + kAliased, Sig::kResults, typename Sig::Attrs>(
      xla::ffi::Ffi::Bind()
          .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
          .Ctx<xla::ffi::DeviceOrdinal>());
}

// The into handler: kImpl, ignoring the `kAliased` inputs after its own. XLA aliases each to
// the result in its place (the caller donates the result's buffer), so only the result is read.
template <auto kImpl, size_t kAliased>
struct SkipAliased {
  static constexpr size_t kInputs = Signature<decltype(kImpl)>::kInputs;

  template <class... Rest>
  xla::ffi::Error operator()(cudaStream_t stream, int32_t device, Rest&&... rest) const {
    return call(stream, device, std::forward_as_tuple(std::forward<Rest>(rest)...),
                std::make_index_sequence<kInputs>{},
                std::make_index_sequence<sizeof...(Rest) - kInputs - kAliased>{});
  }

 private:
  template <class Tuple, size_t... I, size_t... J>
  static xla::ffi::Error call(cudaStream_t stream, int32_t device, Tuple&& args,
                              std::index_sequence<I...>, std::index_sequence<J...>) {
    return kImpl(stream, device, std::get<I>(std::move(args))...,
                 std::get<kInputs + kAliased + J>(std::move(args))...);
  }
};

}  // namespace jax_tma::ffi_util

// Defines the handler symbols OUT and INTO of one op from IMPL (see Signature; a comment per
// parameter there documents each bound argument). OUT binds IMPL's parameters as they are;
// INTO takes ALIASED more inputs after IMPL's own, the initial contents of IMPL's first ALIASED
// results, which the caller donates. Both are command-buffer compatible: they never
// synchronize or allocate.
#define JAX_TMA_DEFINE_HANDLER_PAIR(OUT, INTO, IMPL, ALIASED)                             \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(OUT, IMPL,                                                \
                                (::jax_tma::ffi_util::handler_binding<&IMPL, 0>()),       \
                                {::xla::ffi::Traits::kCmdBufferCompatible});              \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(INTO, (::jax_tma::ffi_util::SkipAliased<&IMPL, ALIASED>{}), \
                                (::jax_tma::ffi_util::handler_binding<&IMPL, ALIASED>()), \
                                {::xla::ffi::Traits::kCmdBufferCompatible})
