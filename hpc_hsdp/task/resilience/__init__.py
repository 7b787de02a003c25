"""What keeps a job alive: preemption, a lost node, a hang, and the faults the tests inject."""
