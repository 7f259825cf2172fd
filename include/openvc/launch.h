// Process-wide launch settings of the library's kernels.
//
// Programmatic dependent launch (Hopper): the preparation's V kernels and the attention kernel are launched so
// that each may start while the kernel before it on the stream drains (its CTAs take SMs as they free up and
// set up shared memory); each waits on the device for the previous grid's writes before it reads them
// (griddepcontrol.wait), so results are the same either way. On by default; OPENVC_PDL=0 in the environment
// at the first launch turns it off. Thread-safe; it applies to launches enqueued after the call (a CUDA graph
// keeps what it captured).
#pragma once

namespace openvc {

bool programmatic_launch();
// Returns the previous setting.
bool set_programmatic_launch(bool on);

}  // namespace openvc
