"""`python -m dtjob.launcher -- COMMAND...`: the agent of a worker pod (as torchrun's local agent).

    agent.py        the pod's main process: runs the trainers, passes signals, decides the pod's exit
    local.py        the pod's trainer processes (LOCAL_WORLD_SIZE of them) and their warm standbys
    standby.py      a process that imported torch ahead of time and becomes a trainer when asked
    coordinator.py  pod 0's agent: restarts the whole gang in place, inside the running pods
    protocol.py     the messages between agents, coordinator and standbys (typed, one JSON line each)

The operator runs a pod through it when the pod has several trainer processes
(spec.nprocPerWorker) or restarts in place (spec.elastic.restartInPlace).
"""
