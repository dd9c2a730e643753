// Shared by the bindings: a backend's buffer regions as a Python dict (region -> bytes per rank).
#pragma once

#include <nanobind/nanobind.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace a2a::python {

nanobind::dict regions_dict(const std::vector<std::pair<std::string, int64_t>>& regions);
void bind_config(nanobind::module_& m);

}  // namespace a2a::python
