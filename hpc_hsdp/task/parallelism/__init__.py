"""The process group and the mesh, and how a model is sharded, compiled and placed on its device."""
