"""The sandbox's pod runtime: a kubelet stand-in that really runs pods of registered images.

kwok plays the kubelet of the fake GPU nodes but runs nothing. For pods whose containers use an
image the runtime knows (`images.default_registry()`: the CacheRoute image and vLLM's), the
runtime does what a kubelet would: it materialises volumes (ConfigMaps, Secrets, projected
service-account tokens, downward API, emptyDir) and mounts them in a private mount namespace per
container, builds the environment, runs the container (a local process, or an emulated vLLM server
hosted in the runtime's own event loop), writes its logs, runs its probes, reports container and
pod status, restarts what fails and stops everything gracefully when the pod is deleted.
"""
