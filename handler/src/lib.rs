//! virt-handler: the per-node agent that wires TAP devices and syncs launchers (filled by the
//! handler issue).
