"""The producer: the detached guest script that writes one snapshot (see
:mod:`wsync.protocol.scripts` for the staging layout and the rules every script keeps).

It runs in one of three modes (issue 8): ``tar`` archives the whole workspace with the
settle re-read rounds; ``manifest`` writes one record per entry
(:mod:`wsync.protocol.manifest`) instead of a tar; ``select`` archives exactly the
entries of an uploaded list.  Each writes the same compressed, chunk-indexed, hashed
``data`` stream and the same ``done``/``failed`` records, so the host reads them all
with the same verified, journaled, resumable chunk reads.
"""

from __future__ import annotations

from wsync.protocol.records import FIRST_CHUNK, GROWTH_STEPS

#: the guest's pid checks, shared by the producer and the host's scripts
#: (:mod:`wsync.protocol.scripts` ends its prelude with them): one text, two scripts
PID_CHECKS = r"""
# (the state is the field after the last ") " of /proc/PID/stat, taken without a
# fork: this runs in every look of the producer's loop and of a status long poll;
# read's status is not looked at, as a line without its newline still counts; kill's
# complaint goes where every stderr of the producer and the scripts goes, nowhere.
# A pid is digits, left unquoted here and in busy: these lines ride in every admission's
# argv, a URL on some backends, where each quote costs three bytes)
alive() {
  kill -0 $1 || return 1
  if [ -r /proc/$1/stat ]; then
    rd /proc/$1/stat
    v_=${v_##*) }
    case ${v_%% *} in Z) return 1 ;; esac
  fi
  return 0
}
# a pid read from staging that may still be snapshot dir $d's producer (or its
# launch): alive and, where /proc tells, running wsync's producer on that very dir (a
# dead producer's pid that another snapshot's producer took is not this one's);
# without /proc any live process counts.  The shell's read drops the NULs between
# arguments (dash, bash and busybox alike), so the producer's path and its dir are
# seen without a fork; where they are not, tr decides as before.  Only a process of
# this user (its /proc dir is ours: test -O, no fork): another user of the guest may
# run any argv on a dead producer's reused pid, which must not keep the snapshot
# "running" (adopted, never launched again, waited for until the pull's deadline)
busy() {
  case $1 in ''|0*|1|*[!0-9]*|??????????*) return 1 ;; esac
  alive $1 || return 1
  [ -r /proc/$1/cmdline ] || return 0
  [ -O /proc/$1 ]||return 1
  rd /proc/$1/cmdline
  case $v_ in */.producer-*"$d"*) return 0 ;; esac
  case $(cmd $1) in *.producer-*" $d "*) return 0 ;; esac
  return 1
}
cmd() { tr '\000' ' ' < /proc/$1/cmdline; }
# the first line of a small file into v_, without the fork of "$(cat FILE)" (empty when
# the file is missing): the pid files, read in every look of the loops that wait
rd() { v_=; IFS= read -r v_ < "$1"; }
"""

#: the status of a snapshot, shared like :data:`PID_CHECKS`: the status call's script holds
#: it, and so does the producer, whose ``--status`` mode answers it for an admission that
#: carries the first status (the admission has just checked the producer's hash; the
#: function's 1.6 KB stay out of its argv, which must fit a URL on some backends)
STATUS_FN = r"""
# the status of snapshot dir $1 into p: the status call's answer, and the one an
# admission carries (the call that follows it, saved)
st() {
d=$1 io=$2 w=$3 il=$4 b= dn=
[ -d "$d" ] || { p="exists 0"; return 0; }
touch -c "$d"
al() {
  alive=0
  for x in pid pid.launch; do rd "$d/$x"; busy "$v_" && alive=1; done
}
# a long poll: up to w looks, until the index grows past io, a result is written or
# (checked once) no producer runs; then the index from io comes along.  Looks are
# 50 ms apart, the first twenty 5 ms (a small workspace's producer is done by then;
# a look is one fork, the sleep, as the index's size is read from isize).  Liveness is
# asked again only if time passed
al
k=0 dw=0
while [ $alive = 1 ] && [ "$k" -lt "$w" ] && [ ! -f "$d/done" ] && [ ! -f "$d/failed" ]; do
  # the producer writes the index's size to isize after each line (a hint read without
  # a fork; the answer below measures the index itself); without it, wc.  No index yet
  # counts as empty: the producer is starting (an admission's status runs before it has
  # detached)
  rd "$d/isize"
  case $v_ in
    ''|0?*|*[!0-9]*|????????????????*) isz=$(wc -c < "$d/index") || isz=0 ;;
    *) isz=$v_ ;;
  esac
  if [ $((isz + 0)) -gt "$io" ]; then
    # grown: the answer goes now, unless a small stream may come along (il) and only the
    # producer's last steps are left (comp.rc: the final index lines, the whole hash, the
    # done record): then it looks for the record five times, 2 ms apart, and carries it.
    # (Bounded: a big stream's last steps hash it whole, and its last index lines must
    # not wait for that)
    [ "$il" -gt 0 ] && [ -f "$d/comp.rc" ] && [ "$dw" -lt 5 ] || break
    dw=$((dw + 1))
    sleep 0.002 2>/dev/null || break
  elif [ $k -lt 20 ]; then sleep 0.005 2>/dev/null || break; else sleep 0.05 2>/dev/null || break; fi
  k=$((k + 1))
done
[ $k = 0 ] || al
p="exists 1"
if [ -f "$d/done" ]; then dn=1 l=; while IFS= read -r l || [ -n "$l" ]; do p="$p${nl}done_$l"; done < "$d/done"; fi
if [ -f "$d/failed" ]; then p="$p${nl}failed $(head -c 400 "$d/failed" | tr '\n' ' ')"; fi
launched=0
[ -d "$d/launch" ] && launched=1
isz=$(wc -c < "$d/index") || isz=0
dsz=$(wc -c < "$d/data") || dsz=0
p="$p${nl}alive $alive${nl}launched $launched"
p="$p${nl}index_size $((isz + 0))${nl}data_size $((dsz + 0))"
# a finished stream of at most il bytes comes along whole, in base64 (a read call fewer
# for every small run: the host checks each chunk against the index's hash as a read's).
# Finished as the record above says (dn), not by looking again: a record written since
# would have the stream carried, and its staging removed, without the record
if [ "$il" -gt 0 ] && [ "$io" -ge 0 ] && [ -n "$dn" ] && [ $((dsz + 0)) -gt 0 ] &&
  [ $((dsz + 0)) -le "$il" ]; then
  b=$(base64 < "$d/data" | tr -d '\n') && p="$p${nl}data_b64 $b" || b=
fi
if [ "$io" -ge 0 ] && [ $((isz + 0)) -gt "$io" ]; then
  t=$(dd if="$d/index" bs=65536 iflag=skip_bytes,count_bytes skip="$io" count=65536; echo .)
  t=${t%.}
  p="$p${nl}index_from $io${nl}index_tail ${#t}${nl}index_follows${nl}$t"
fi
if [ -s "$d/tar.err" ]; then p="$p${nl}tar_err_follows${nl}$(head -c 2000 "$d/tar.err")"; fi
# renamed away meanwhile (an admission that carried it removed it): what was read may be torn
[ -d "$d" ] || { p="exists 0"; b=; }
}
"""

#: a path's mode (``m``) and owner's uid (``u``) from ``ls -ldn``, without following a
#: last-component link; shared by the host's scripts (the staging root's checks) and the
#: producer (its ``--gc`` mode's kills)
LSN = r"""
lsn() { set -f; set -- $(ls -ldn "$1"); set +f; m=${1:-?} u=${3:-?}; }
"""

#: the kill of a stale snapshot's producer (``me`` and ``pn``, the producer's file name, set
#: by the caller), shared by the cleanup script and the producer's ``--gc`` mode
KILL_FNS = r"""
# a pid read from staging is killed only when it is a process of this user
# running wsync's producer on that very snapshot dir (a pid reused by another pull's
# producer is not this one's); without /proc nothing is killed.  (The dir is d, which
# stop sets: busy looks for it too)
mine() {
  busy "$1" && [ -r "/proc/$1/cmdline" ] || return 1
  lsn "/proc/$1"
  [ "$u" = "$me" ] || return 1
  case $(cmd "$1") in *"/$pn $d "*) return 0 ;; esac
  return 1
}
stop() {
  d=$1
  for k in pid pid.launch; do
    rd "$1/$k"
    s=$v_
    mine "$s" && { kill -TERM "-$s" || kill "$s"; }
  done
}
"""

#: the admission's collection of stale snapshots, in the producer's ``--gc`` mode: the
#: admission runs it right after checking the producer's hash, and its text (with
#: :data:`KILL_FNS`, 1.3 KB in a URL) stays out of the admission's argv
GC_FN = r"""
gc() {
root=$1 id=$2 ttl=$3 pn=$4
me=$(id -u)
# garbage-collect stale snapshots: only wsync's own (an id-shaped name holding
# a launch/ token), never anything else that happens to live in the root.  One find
# says which are old, install leftovers too (a find per leftover was most of an
# admission's programs), and a name counts only as a whole line of its answer.  (A
# name with a newline could spell another snapshot's: only this user can make one
# here, who could remove that snapshot as well; its pull then fails, the host never
# takes a wrong byte)
o=$nl$(find "$root"/s* "$root"/.producer-*.part* -prune -mmin +$ttl)$nl
for x in "$root"/s*; do
  [ -d "$x/launch" ] || continue
  [ "${x##*/}" = "$id" ] && continue
  case $o in *"$nl$x$nl"*) ;; *) continue ;; esac
  stop "$x"
  rm -rf "$x"
done
# and what an install cut off left: its parts and join (a live install's are seconds
# old; any run's and any producer version's, the names the install script gives)
for x in "$root"/.producer-*.part*; do
  case $o in *"$nl$x$nl"*) rm -f "$x" ;; esac
done
}
"""

_TEXT = (
    r"""
set -u
# tar's diagnostics in English with names escaped: torn() reads them; and byte
# semantics in the shell (the status measures the index's tail with ${#t})
LC_ALL=C
export LC_ALL
nl='
'
"""
    + PID_CHECKS
    + STATUS_FN
    + KILL_FNS
    + GC_FN
    + LSN
    + r"""
# a finished stream the status carried whole is the host's from then on (the host asks
# for this only of a guest whose base64 encoded the probe's text right, and checks each
# chunk against the index the same answer carries): its staging goes now, which saves
# the pull's cleanup call.  Renamed away first: a rerun of a pull killed meanwhile sees
# the whole snapshot or none, never half of one (nor loses a list it uploads again to
# this removal)
carried() {
  [ -n "$b" ] && [ ! -s "$d/unstable" ] && [ ! -s "$d/gone" ] && mv "$d" "$d.$$" || return 0
  rm -rf "$d.$$"
  p="cleaned 1${nl}$p"
}
# the admission's helpers, from this hashed text (see STATUS_FN and GC_FN); nothing
# else runs: --status SNAPSHOT_DIR INDEX_FROM LOOKS INLINE CLEAN prints the snapshot's
# status (with CLEAN 1, a stream it carried whole has its staging removed: see
# carried), --gc ROOT SNAPSHOT_ID TTL_MINUTES PRODUCER_NAME removes stale snapshots
case ${1-} in
  --status)
    [ $# = 6 ] || exit 2
    st "$2" "$3" "$4" "$5"
    [ "$6" = 1 ] && carried
    printf '%s' "$p"
    exit 0 ;;
  --gc)
    [ $# = 5 ] || exit 2
    gc "$2" "$3" "$4" "$5"
    exit 0 ;;
esac
d=$1 ws=$2 cs=$3 hid=$4 comp=$5 mode=$6 tl=$7
shift 7
cd "$d" || exit 1
h() {
  case $hid in
    xxh128) xxhsum -H2 ;;
    b2) b2sum ;;
    sha256) sha256sum ;;
  esac
}
# one producer per snapshot, however many launches (a retried admission launches
# again when it finds nothing running): each run claims the next generation, lock.N,
# and only while the previous generation's producer is provably gone without a
# result.  A claim is a directory renamed into place with the pid already inside,
# so it is never half made; of two renames to one name only one lands there (the
# other moves into it, or fails), and the pid inside says who won
g=1
while [ -d "lock.$g" ]; do g=$((g + 1)); done
o=
if [ $g -gt 1 ]; then
  rd "lock.$((g - 1))/pid"
  o=$v_
  busy "$o" && exit 0
  [ -f done ] || [ -f failed ] && exit 0
fi
# (a claim left by an earlier process of this pid: gone first)
[ -e "claim.$$" ] || [ -L "claim.$$" ] && rm -rf "claim.$$"
mkdir "claim.$$" && echo $$ > "claim.$$/pid" || exit 1
mv "claim.$$" "lock.$g" 2>/dev/null
rd "lock.$g/pid"
[ "$v_" = $$ ] || exit 0
# whether every process of group $1 is this user's, where /proc tells: the dead
# generation's group id may since name another user's group (its leader gone, its
# children on), whose processes a pull as root must never kill.  (Without /proc, as
# before: a kill reaches only this user's processes, but root's.)  A process group never
# mixes the old pipeline with another user's processes, so one stranger says it all
owngroup() {
  for p_ in /proc/[0-9]*; do
    rd $p_/stat 2>/dev/null
    set -f; set -- ${v_##*) }; set +f
    [ "${3-}" != $o ] || [ -O $p_ ] || return 1
  done
}
if [ $g -gt 1 ]; then
  # what the dead generation left must not mix into the new stream: its pipeline
  # (if only its shell died: its group, never ours, and only if it is all this user's;
  # only once its leader is gone, as the id of a live group is never reused), and its
  # files
  case $o in ''|0*|1|*[!0-9]*|??????????*) ;; *)
    if ! alive "$o" && [ "$o" != "$(sed 's/.*) //' /proc/$$/stat | cut -d ' ' -f 3)" ] &&
      owngroup; then
      kill -KILL "-$o" 2>/dev/null
    fi ;;
  esac
  rm -f data index isize tar.err tar.rc comp.rc comp.err unstable gone chg live m prev tick.t \
    sel0 sel1 done.tmp pid.tmp
fi
fail() {
  # a failed write on a full disk says so: the host names the figures
  f=$(df -Pk . | awk 'NR==2{print $4+0}')
  [ "${f:-9999}" -lt 1024 ] && set -- "disk-full $f: $1"
  # failed.tmp was reserved at start: rewriting it in place (1<>, no
  # truncation) needs no new disk blocks, so a full disk can still say why
  printf '%s\n' "$1" 1<> failed.tmp
  mv -f failed.tmp failed
  trap '' TERM
  kill -TERM 0 2>/dev/null
  exit 1
}
printf '%512s\n' '' > failed.tmp || exit 1
echo $$ > pid.tmp && mv -f pid.tmp pid || fail "cannot write the pid file"
: > index || fail "cannot create the index"
: > data || fail "cannot create the data file"
# COMPRESSOR:LEVEL, the level chosen by the host from the link's speed
# (wsync.protocol.level); gzip stops at 9
lv=${comp##*:}
comp=${comp%%:*}
case $lv in [1-9]|1[0-9]) ;; *) fail "bad compression level" ;; esac
case $comp in
  zstd) z() { zstd -q -c "-$lv" -T0; } ;;
  zstdl) z() { zstd -q -c "-$lv" -T0 --long=25; } ;;
  gzip) [ "$lv" -gt 9 ] && lv=9; z() { gzip -c "-$lv"; } ;;
  *) fail "unknown compressor" ;;
esac
# files whose status changed after a mark were (maybe) read torn: GNU tar reads
# again, up to 3 more rounds, every entry changed since the mark before the
# previous read (-N: a recursive walk through directory fds, like the first
# read, so a directory swapped for a symlink is never followed), appending the
# archives to the same stream (the host applies later archives over earlier
# ones); non-directories that still changed in the last round are listed in
# "unstable", ones that vanished after a torn read in "gone" (NUL-separated)
D=$(pwd -P) || exit 1
# the tools the host's probe saw (asked there, not by each run): g for GNU tar (s: it
# has --sort), c for find's -cnewer, p for its -printf
cn=-newer gnu=0 pf= srt=
case $tl in *g*) gnu=1 ;; esac
case $tl in *c*) cn=-cnewer ;; esac
case $tl in *p*) pf=1 ;; esac
case $tl in *s*) srt=--sort=name ;; esac
# the workspace's filesystem stamps whole seconds (ext4 of 128-byte inodes): its root's
# ctime, which no one can set, has no fraction (see tick).  So does any filesystem mounted
# inside it (a volume, a bind mount: tar reads it too), where /proc lists them (mountinfo's
# fifth field, with a space, tab, newline or backslash as \040, \011, \012, \134)
ws1=
sec() { case $(stat -c %z "$1" 2>/dev/null) in *.000000000\ *) ws1=1 ;; esac; }
sec "$ws/."
if [ -z "$ws1" ] && [ -r /proc/self/mountinfo ] && cd -P "$ws" 2>/dev/null; then
  # (its physical path, as mountinfo gives them, without the fork of a "$(pwd -P)")
  wp_=${PWD%/}/
  cd "$D" || fail "cannot return to the staging directory"
  while [ -z "$ws1" ] && read -r a_ a_ a_ a_ mp_ a_; do
    case $mp_ in *\\*) mp_=$(printf '%s\n' "$mp_" |
      sed 's/\\040/ /g;s/\\011/\t/g;s/\\012/\n/g;s/\\134/\\/g'; echo .); mp_=${mp_%?.} ;; esac
    case $mp_ in "$wp_"?*) sec "$mp_" ;; esac
  done < /proc/self/mountinfo
fi
tick() {
  : > m && : > tick.t || fail "cannot write a mark"
  t_=0
  until [ -n "$(find tick.t -newer m)" ]; do
    # 2 ms apart at first (a file clock ticks within a few ms), then 10 ms (where file
    # times are coarse, FAT or some NFS: each look is a program)
    if [ $t_ -lt 5 ]; then sleep 0.002 2>/dev/null || sleep 1; else sleep 0.01 2>/dev/null || sleep 1; fi
    t_=$((t_ + 1))
    : > tick.t
  done
  # a workspace that stamps whole seconds (ws1): an edit in the mark's own second, tar
  # reading, would be stamped before the mark (find would not list it, tar -N not read it
  # again).  The mark goes back to the start of its second and the read waits for the
  # file clock's next one: what changes while it reads is stamped later than the mark
  # (up to a second a round, on such a workspace only)
  if [ -n "$ws1" ]; then
    s_=$(stat -c %Y m) && touch -d @$s_ m || fail "cannot write a mark"
    t_=0
    until : > tick.t && [ $(stat -c %Y tick.t) -gt $s_ ]; do
      [ $t_ -lt 99 ] || fail "cannot write a mark"
      sleep 0.02 2>/dev/null || sleep 1
      t_=$((t_ + 1))
    done
  fi
}
# without -cnewer (busybox) only mtimes tell, and a file dated in the future is newer than
# any mark: "changed during the read" is then newer than the mark and not than an end mark
# set after the read (else such a file was unstable in every pull, --full included)
changed() {
  : > end.t || fail "cannot write a mark"
  if [ "$cn" = -newer ]; then
    (cd "$ws" && find . -newer "$D/m" ! -newer "$D/end.t" ! -type d -print0) > chg
  else
    (cd "$ws" && find . "$cn" "$D/m" ! -type d -print0) > chg
  fi || fail "cannot list changed files"
}
# (a name past PATH_MAX cannot be tested in one call and fails [ -e ] as if it were gone:
# it counts as still there, so it is read again, and at worst ends up unstable, never
# taken for deleted; ${#f} counts bytes under LC_ALL=C)
exists() {
  [ -s "$1" ] || { : > "$2"; return; }
  (cd "$ws" && xargs -0 sh -c 'for f; do if [ -e "$f" ] || [ -L "$f" ] || [ ${#f} -ge 4096 ]; then printf "%s\0" "$f"; else printf "%s\0" "$f" >&3; fi; done' sh) < "$1" > "$2" 3>> gone || fail "cannot check changed files"
}
rounds() {
  tick
  tar $srt -cf - -C "$ws" . 2>>tar.err
  echo $? > tar.rc
  changed
  k=0
  while [ -s chg ] && [ "$gnu" = 1 ] && [ $k -lt 3 ]; do
    k=$((k + 1))
    mv -f m prev || fail "cannot write a mark"
    tick
    tar $srt -cf - -N "$D/prev" -C "$ws" . 2>>tar.err
    rc=$?
    rd tar.rc
    [ $rc -gt "$v_" ] && echo $rc > tar.rc
    exists chg live
    changed
  done
  exists chg live
  torn
  if [ -s live ]; then mv -f live unstable || fail "cannot record unstable files"; fi
}
# a file tar read torn and that vanished before the next find is in no list:
# tar named it ("changed as we read it", "shrank"); gone if it is still absent (one
# still there changed after the mark, so a later round read it again, or lists it).
# tar gives an odd name in its escape quoting (C locale): \ooo for a byte, \\, \t, \n
# and the like, \: for a colon.  That is printf's format once % is doubled and \: is a
# colon (a colon always comes escaped, so the \ before one is its own).  Taken only
# where tar quotes the name so found as it gave it (--no-unquote: tar would read a name
# given to it as quoted); else it stays unstable, the pull's to fail
torn() {
  [ -s tar.err ] || return 0
  sed -n -e 's/^[^ ]*tar: \(.*\): file changed as we read it$/\1/p' \
    -e 's/^[^ ]*tar: \(.*\): File shrank by [0-9]* bytes; padding with zeros$/\1/p' tar.err |
    while IFS= read -r n; do
      case $n in
        *\\*)
          x=$(printf "$(printf '%s\n' "$n" | sed 's/%/%%/g;s/\\:/:/g')."); x=${x%.}
          case $(cd "$ws" && tar --no-unquote -cf /dev/null "$x/.n" 2>&1) in
            *"tar: $n/.n: "*) n=$x ;;
            *) printf '%s\0' "$n" >> live; continue ;;
          esac ;;
      esac
      [ -e "$ws/$n" ] || [ -L "$ws/$n" ] || [ $((${#ws} + ${#n})) -ge 4095 ] ||
        printf '%s\0' "$n" >> gone
    done
}
: > gone || fail "cannot create the gone list"
# mode manifest: one record per entry instead of a tar (wsync.protocol.manifest); the
# arguments left are find -name globs of excluded names, pruned here so that their
# bytes never cross.  GNU find prints ns times, ctime, inode and device; busybox find has
# no -printf, so there each name goes through stat -c (whole seconds, ctime, inode, device)
manifest() {
  n=$#
  for g do
    if [ $# -eq $n ]; then set -- "$@" -name "$g"; else set -- "$@" -o -name "$g"; fi
  done
  shift $n
  [ $# -eq 0 ] || set -- ! -path . \( "$@" \) -prune -o
  if [ -n "$pf" ]; then
    (cd "$ws" && find . -ignore_readdir_race "$@" -printf '%y %m %s %T@ %C@ %i:%D\0%p\0%l\0') 2>>tar.err
  else
    # one stat per batch of names (a process per entry made a 6,000-entry listing take
    # 12 s): its lines carry no name, one per name in order, so they pair up with the
    # names whatever bytes those hold; if any name fails (it vanished), the batch is
    # done again a stat per name, and the one that failed is skipped
    (cd "$ws" && find . "$@" -print0 | xargs -0 sh -c '
      one() {
        set -f
        set -- $s
        set +f
        a=$1 sz=$2 mt=$3 ct=$4 in=$5
        shift 5
        case $* in
          "regular file"|"regular empty file") k=f ;;
          directory) k=d ;;
          "symbolic link") k=l ;;
          fifo|FIFO) k=p ;;
          "character special file") k=c ;;
          "block special file") k=b ;;
          socket) k=s ;;
          *) return ;;
        esac
        t=
        if [ $k = l ]; then t=$(readlink -- "$f"; echo .); t=${t%?}; t=${t%?}; fi
        printf "%s %s %s %s %s %s\0%s\0%s\0" "$k" "$a" "$sz" "$mt" "$ct" "$in" "$f" "$t"
      }
      fmt="%a %s %Y %Z %i:%d %F"
      if stat -c "$fmt" -- "$@" > "$0" 2>/dev/null; then
        exec 4< "$0"
        for f; do IFS= read -r s <&4 || exit 3; one; done
      else
        for f; do s=$(stat -c "$fmt" -- "$f") || continue; one; done
      fi' "$D/stat.out") 2>>tar.err
  fi
  rc=$?
  # busybox find and stat say what they cannot read (a name past PATH_MAX, a directory
  # this user may not open) and go on, and xargs's status hides find's: an entry left
  # out of the listing would be taken for deleted, so any such line fails it (an entry
  # that vanished while listed stays a skip, as with GNU find's readdir race)
  [ -s tar.err ] && [ -n "$(sed -n -e '/No such file or directory/d' -e '/Not a directory/d' \
    -e '/^find: /p' -e '/^stat: /p' -e '/^readlink: /p' tar.err | head -n 1)" ] && rc=2
  [ $rc = 0 ] || rc=2
  echo $rc > tar.rc
}
# mode select: archive exactly the entries named in "list" (NUL-separated, "./"-prefixed,
# uploaded and hash-checked by the host beforehand).  tar reads them by path (-T): a guest
# that swaps a parent directory for a symlink can only make tar read other guest files it
# could show us anyway; the host extractor stays confined and the next manifest sees the
# swap.  Listed entries that are gone go to "gone"; the settle rounds read again those
# listed entries changed since the mark, like rounds() does for the whole tree
lchanged() {
  : > chg || fail "cannot list changed files"
  [ -s "$1" ] || return 0
  : > end.t || fail "cannot write a mark"
  (cd "$ws" && xargs -0 sh -c 'c=$0 m=$1 e=$2; shift 2; if [ "$c" = -newer ]; then
    find "$@" -prune ! -type d -newer "$m" ! -newer "$e" -print0; else
    find "$@" -prune ! -type d "$c" "$m" -print0; fi' "$cn" "$D/m" "$D/end.t") < "$1" > chg 2>/dev/null
  return 0
}
# an empty list is an empty archive (two zero blocks); busybox tar has no -T in some
# builds, so there the names go through xargs, one archive per batch, appended (the host
# reads archives appended to one stream); the list holds no directories
sel() {
  if [ ! -s "$1" ]; then
    dd if=/dev/zero bs=1024 count=1 2>/dev/null
  elif [ "$gnu" = 1 ]; then
    tar -cf - --null --no-recursion --ignore-failed-read -C "$ws" -T "$D/$1" 2>>tar.err
  else
    xargs -0 sh -c 'tar -cf - -C "$0" "$@"' "$ws" < "$1" 2>>tar.err || return 2
  fi
}
choose() {
  [ -f list ] || fail "no list"
  exists list live
  mv -f live sel0 || fail "cannot write the list"
  tick
  sel sel0
  echo $? > tar.rc
  lchanged sel0
  k=0
  while [ -s chg ] && [ "$gnu" = 1 ] && [ $k -lt 3 ]; do
    k=$((k + 1))
    exists chg live
    mv -f live sel1 || fail "cannot write the list"
    tick
    sel sel1
    rc=$?
    rd tar.rc
    [ $rc -gt "$v_" ] && echo $rc > tar.rc
    lchanged sel1
  done
  exists chg live
  torn
  if [ -s live ]; then mv -f live unstable || fail "cannot record unstable files"; fi
  # --ignore-failed-read: a listed entry that vanished is in "gone", any other error fails
  if [ -s tar.err ] && [ -n "$(grep -v -e ': Warning: Cannot stat: No such file or directory$' -e ': file changed as we read it$' -e ': File shrank by ' tar.err)" ]; then
    echo 2 > tar.rc
  fi
}
produce() {
  case $mode in
    tar) rounds ;;
    manifest) manifest "$@" ;;
    select) choose ;;
    *) fail "unknown mode" ;;
  esac
}
# the pipeline's end wakes the loop below at once (a trapped signal ends a wait): the
# last chunk and the done record do not wait out a look's sleep, up to 0.2 s a run.
# Only while this shell still runs the producer: were it gone, $$ could be another's
trap 'w_=1' USR1
w_=
{ produce "$@" | { z 2>comp.err; echo $? > comp.rc; } >> data; busy $$ && kill -USR1 $$ 2>/dev/null; } &
pp=$!
seq=0 off=0 isz=0
# chunk N is @FIRST@ << 2N bytes, at most the chunk size (the host checks it by the same
# rule, wsync.protocol.records.chunk_length): the first is ready moments after the start
index_upto() {
  sz=$(wc -c < data) || fail "cannot read the data size"
  sz=$((sz + 0))
  while :; do
    rem=$((sz - off))
    w=$cs
    if [ "$seq" -lt @STEPS@ ]; then
      w=$((@FIRST@ << (2 * seq)))
      [ "$w" -gt "$cs" ] && w=$cs
    fi
    if [ "$rem" -ge "$w" ]; then l=$w
    elif [ "$1" = final ] && [ "$rem" -gt 0 ]; then l=$rem
    else break
    fi
    hv=$(dd if=data bs=65536 iflag=skip_bytes,count_bytes skip="$off" count="$l" 2>/dev/null | h)
    hv=${hv%% *}
    [ -n "$hv" ] || fail "cannot hash chunk $seq"
    ln="C $seq $off $l $hv"
    printf '%s\n' "$ln" >> index || fail "cannot append to the index"
    # the index's size, for status long polls to look at without a fork (a hint: a
    # status answer measures the index itself); ASCII, so characters are bytes
    isz=$((isz + ${#ln} + 1))
    printf '%s\n' "$isz" > isize || rm -f isize
    seq=$((seq + 1))
    off=$((off + l))
  done
}
# a chunk is indexed within moments of being complete: the wait between looks starts
# at 10 ms and doubles while nothing new is indexed, up to 0.2 s (a small snapshot is
# done in one or two looks; a big one's chunks, seconds apart on a slow guest, cost a
# few idle looks each); after a new chunk it is back at 50 ms
zz=0.01
while [ ! -f comp.rc ] && alive "$pp"; do
  s0=$seq
  index_upto live
  if [ "$seq" != "$s0" ]; then zz=0.05; else
    case $zz in 0.01) zz=0.02 ;; 0.02) zz=0.05 ;; 0.05) zz=0.1 ;; *) zz=0.2 ;; esac
  fi
  # woken while indexing, or before or during the wait: no sleep is waited out.  A
  # sleep cut short is still our unreaped child (its pid is not reused before the
  # kill); a sleep that takes no fractions fails at once
  [ -f comp.rc ] && continue
  sleep $zz 2>/dev/null &
  sp=$!
  if [ -n "$w_" ]; then kill $sp 2>/dev/null
  elif wait $sp; then :
  elif [ -n "$w_" ]; then kill $sp 2>/dev/null
  else sleep 1
  fi
done
wait "$pp"
rd tar.rc
trc=$v_
[ -n "$trc" ] || fail "tar exit status missing"
rd comp.rc
crc=$v_
[ -n "$crc" ] || fail "compressor exit status missing"
[ "$crc" = 0 ] || fail "compressor exited $crc: $(head -c 300 comp.err | tr '\n' ' ')"
case $mode in manifest) what="the listing (find)" ;; *) what=tar ;; esac
case $trc in
  0|1) ;;
  *) fail "$what exited $trc: $(head -c 300 tar.err | tr '\n' ' ')" ;;
esac
index_upto final
# (the size index_upto measured, after the pipeline ended: a byte appended since, by
# anyone, fails the host's check of the whole stream's hash below)
len=$sz
[ "$len" = "$off" ] || fail "data is $len bytes but $off were indexed"
# one chunk is the whole stream: its hash is the stream's (a program less per small run)
if [ "$seq" = 1 ]; then whole=$hv; else whole=$(h < data); fi
whole=${whole%% *}
[ -n "$whole" ] || fail "cannot hash the stream"
ub=0
[ -f unstable ] && ub=$(wc -c < unstable)
gb=0
if [ -s gone ]; then gb=$(wc -c < gone) || fail "cannot read the gone list"; fi
printf 'chunks %s\nlength %s\nhash %s\ntar_rc %s\ncomp_rc %s\nunstable_bytes %s\ngone_bytes %s\n' \
  "$seq" "$len" "$whole" "$trc" "$crc" $((ub + 0)) $((gb + 0)) > done.tmp || fail "cannot write the done record"
mv -f done.tmp done || fail "cannot write the done record"
"""
)
#: the chunk schedule's figures go in once, from the one place the host checks them too
_PRODUCER = _TEXT.replace("@FIRST@", str(FIRST_CHUNK)).replace("@STEPS@", str(GROWTH_STEPS))
