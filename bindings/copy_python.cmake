# copy_python.cmake: cmake -DSRC=<python/fastweight> -DDST=<build>/python/fastweight -P copy_python.cmake
# Copies every *.py under SRC to DST keeping the tree (only files that differ are rewritten).
file(GLOB_RECURSE fw_py_files RELATIVE "${SRC}" "${SRC}/*.py")
foreach(f IN LISTS fw_py_files)
  get_filename_component(d "${DST}/${f}" DIRECTORY)
  file(MAKE_DIRECTORY "${d}")
  file(COPY_FILE "${SRC}/${f}" "${DST}/${f}" ONLY_IF_DIFFERENT)
endforeach()
