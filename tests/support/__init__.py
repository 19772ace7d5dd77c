"""Helpers shared by the tests (imported as ``support.<module>``: pytest puts
``tests/`` on ``sys.path``; scripts and subprocesses put it there themselves).

- ``reference``: the pure-numpy reference of every wire format and its error feedback
- ``fakempi``, ``model_check``, ``scenarios``: the model checker for hangs on a fake
  MPI, and the calls it shares with the random schedules on real MPI
- ``launch_contract``, ``simulator_fix``, ``device_order``: the CUDA simulator's launch
  contract, a fix of the simulator, a numpy model of the device's summation order
- ``device_ops``: every driver-level operation of a device call (allocations, copies,
  launches, waits, Python calls), counted in the simulator
- ``foreign_arrays``: arrays that are not numpy arrays (CUDA-like and CPU kinds)
- ``background``: a test module's slow subprocess runs, side by side
- ``docs_harness``: the runner of the documentation's code blocks (a script)
- ``torch_dist``: torch.distributed under mpirun: the gloo process group on the MPI
  ranks (a fixture), and the FSDP2 tests' small sharded model, training and comparisons
"""
