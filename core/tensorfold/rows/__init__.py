"""The rows store: kept states on disk, across evictions and restarts (`--learn-conversations`).

    <learn-dir>/                     mode 0700, ours (guard.py); `FORMAT` names the store format version; `lock`
                                     held by one server (its pid inside), whatever its identity: a second one is
                                     refused by name; nothing under the root is opened through a link
      <identity hash>/               one directory per identity (identity.py): only a server computing the same bits
        identity.json                the facts the hash covers, for `tensorfold learned show`
        usage.json                   each state's last use and hits, saved at close
        blocks/<name>.blk            rows [k·B, (k+1)·B) of the image's rows part (B = --learn-block-rows), named by
                                     the chained hash of the identity, B, the partition and every token up to the
                                     block's end: two states of one partition sharing a prefix share its blocks
        states/<key>.st              one kept state: words (format, version, at, digest, cuts, its blocks), its
                                     tokens, its own part, its last partial block's rows; named by the chained hash
                                     up to `at` and its cuts
      budget.json                    bytes written per UTC day, every identity together (--learn-daily-gib)

Every file is written as `<name>.part`, fsynced, renamed, then the directory fsynced; the data files (`.blk`, `.st`)
end with a trailer (payload length, sha256 of the payload): a crash mid-write leaves a `.part` (removed at startup)
and never a file that reads as valid. The state files are the index: startup reads their headers. Names and hashes:
names.py; file bytes: files.py; one identity's index: shelf.py; the root (lock, FORMAT, budget, listing): root.py;
the root's owner, mode and shape, and the errors of a full or read-only disk: guard.py; startup under the root:
opening.py; the store: store.py; the payoff rule: payoff.py, its startup read rate: probe.py. docs/formats.md
"The rows store on disk" has every byte.
"""
