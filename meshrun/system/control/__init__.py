"""The coordinator's control state: members, tokens, pairs, coordinators and network metadata behind one
protocol (`state.ControlState`), kept in SQLite by a lone coordinator (`coordinatordb`) or in etcd by several
(`etcdstate`, with jobs replicated by `etcdjobs`); the etcd client and member process (`etcd`) and etcd in
memory for tests (`fakeetcd`)."""
