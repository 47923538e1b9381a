# The gRPC-, protobuf- and database-free libraries of server/ that the offline `skyreels` commands use: the
# generation parameter table, its meeting point with the model, the tiny random model. Declared here once, included
# by server/CMakeLists.txt and by the model-only build (-DSKYREELS_MODEL_ONLY=ON), which has no server/.
set(_server ${PROJECT_SOURCE_DIR}/server)
add_library(skyreels_params STATIC ${_server}/job/generation_params.cpp)
target_include_directories(skyreels_params PUBLIC ${PROJECT_SOURCE_DIR})
target_link_libraries(skyreels_params PUBLIC skyreels_sampler_table PRIVATE skyreels_warnings)
add_library(skyreels_params_model STATIC ${_server}/job/generation_params_model.cpp)
target_link_libraries(skyreels_params_model PUBLIC skyreels_params skyreels_generation PRIVATE skyreels_warnings)
add_library(skyreels_demo STATIC ${_server}/replica/demo_model.cpp)
target_include_directories(skyreels_demo PUBLIC ${PROJECT_SOURCE_DIR})
target_link_libraries(skyreels_demo PUBLIC skyreels_transformer skyreels_vae PRIVATE skyreels_warnings)
