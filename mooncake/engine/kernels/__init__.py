"""The engine's own C kernels for decode (built by ``mooncake.native_build``) and the decode step that
uses them; torch's ops serve where they are off."""
