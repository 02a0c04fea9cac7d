// The one torch.library namespace of the compiled extension, `specdec_C`
// (the public namespace `specdec` is defined in Python by the package; its
// CUDA backend calls the raw ops registered here). Each op's file in this
// folder defines its schema (a fragment of the namespace) and registers its
// CPU (host program), CUDA and Meta implementations.
#include <Python.h>

#include <torch/library.h>

// The namespace's owner: its ops are defined by the fragments.
TORCH_LIBRARY(specdec_C, m) {}

// `import specdec_kernels._C` loads this library, which runs every file's
// registrations; the module itself has no attributes.
extern "C" PyMODINIT_FUNC PyInit__C(void) {
  static PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module_def);
}
