// The typed builder: a launch that misspells an argument does not compile.
use specplan_kernels::entries::norm::RmsNormPtrs;

fn main() {
    let _ = RmsNormPtrs { x: 1u64, wieght: 2u64, out: 3u64 };
}
