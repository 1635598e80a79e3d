"""A stand-in for torchvision, on PYTHONPATH only for the tests that run a real client script
needing `torchvision.transforms` (diffusers' train_unconditional.py): torchvision's wheels are
built against other torch builds and do not import with this CPU torch. Only the transforms
those scripts use, with torchvision's semantics for the inputs they get (PIL images, then
tensors); the Accelerate run and the shardwise run of a script both use it, so their numbers
are compared like for like."""
