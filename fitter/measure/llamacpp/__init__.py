"""llama.cpp itself: one shared build of the pinned source (`tools`), llama-cpp-python on its libraries
(`bindings`), a user's build folder (`builds`), llama.cpp's own fit (`fit_params`: llama-fit-params) and a build's
projection of a config (`projection`)."""
