// The CPU attention kernels in portable code (ATen's generic Vectorized<float>), compiled with
// the baseline flags: what runs where no wider instruction set is available or allowed
// (ATEN_CPU_CAPABILITY=default).
#define CPU_CAPABILITY DEFAULT
#define CPU_CAPABILITY_DEFAULT
#include "attention_kernel_impl.h"

MHAKERN_DEFINE_KERNEL_TABLE(DEFAULT)
MHAKERN_DEFINE_FLEX_RUNTIME(DEFAULT)
MHAKERN_DEFINE_BF16_TABLE(DEFAULT_BF16MODEL, DEFAULT, DotModel)
