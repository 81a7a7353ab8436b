from wsync.cli import main

raise SystemExit(main())
