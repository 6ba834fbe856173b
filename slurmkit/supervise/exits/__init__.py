"""The ways out of an allocation through Slurm: the in-place requeue and its release helper
(requeue), the successor job (successor), node 0's succession when it is lost (succession),
what ended the previous attempt (previous), a preemption's requeue (preemption), and the caps a
requeue is checked against (caps). The supervisor's exits object
(slurmkit.supervise.endings.Endings) drives them; they know nothing of the loop."""
