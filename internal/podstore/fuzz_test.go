package podstore

import (
	"encoding/json"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
	"time"
)

// sampleRecord is a record as the agent writes it.
func sampleRecord() Record {
	return Record{
		Key:         Key{Network: "k8s-pod-network", ContainerID: "c0ffee", Ifname: "eth0"},
		Namespace:   "shop",
		Name:        "cart-7d9f",
		UID:         "0f1e2d3c-aaaa-bbbb-cccc-123456789abc",
		NetnsPath:   "/var/run/netns/cni-1234",
		NetnsCookie: 4096,
		Interfaces:  []Interface{{Name: "eth0", MAC: "0a:58:0a:01:00:05", Addresses: []string{"10.1.0.5/24", "fd00::5/64"}}},
		Source:      "SOURCE_CNI",
		EnrolledAt:  time.Date(2025, 1, 2, 3, 4, 5, 6, time.UTC),
	}
}

// sameRecord compares records field by field, times by instant: a time read
// back from JSON carries a different *Location than the one written.
func sameRecord(a, b Record) bool {
	if !a.EnrolledAt.Equal(b.EnrolledAt) {
		return false
	}
	a.EnrolledAt, b.EnrolledAt = time.Time{}, time.Time{}
	return reflect.DeepEqual(normalized(a), normalized(b))
}

// normalized makes empty collections nil: JSON omits them, so an empty and an
// absent list or map are the same record.
func normalized(r Record) Record {
	if len(r.Interfaces) == 0 {
		r.Interfaces = nil
	} else {
		ifs := make([]Interface, len(r.Interfaces))
		copy(ifs, r.Interfaces)
		for i := range ifs {
			if len(ifs[i].Addresses) == 0 {
				ifs[i].Addresses = nil
			}
		}
		r.Interfaces = ifs
	}
	if len(r.Labels) == 0 {
		r.Labels = nil
	}
	if len(r.Annotations) == 0 {
		r.Annotations = nil
	}
	return r
}

// fastTempDir is a temporary directory on tmpfs when the machine has one, so the
// fuzzer's file churn does not wait on a busy disk.
func fastTempDir(t *testing.T) string {
	t.Helper()
	dir, err := os.MkdirTemp("/dev/shm", "podstore-fuzz-")
	if err != nil {
		return t.TempDir()
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	return dir
}

// FuzzReadRecord feeds arbitrary bytes to the record parser and to Open, as a
// crash mid-write, a full disk or an older agent could leave them:
//   - nothing panics and Open never fails because of a record's content;
//   - a record is accepted only with a complete key, and only under the name its
//     key gives; anything else is moved aside as .corrupt and reported;
//   - an accepted record survives Put and a fresh Open unchanged;
//   - stray temporary files are removed.
func FuzzReadRecord(f *testing.F) {
	good, err := json.Marshal(sampleRecord())
	if err != nil {
		f.Fatal(err)
	}
	f.Add(good, true)
	f.Add(good[:len(good)/2], true) // truncated write
	f.Add([]byte(`{"key":{"network":"n","containerID":"c","ifname":"eth0"}}`), true)
	f.Add([]byte(`{"key":{"network":"n","containerID":"c"}}`), true)
	f.Add([]byte(`{"key":{"network":"n","containerID":"c","ifname":"eth0"},"enrolledAt":"0000-01-01T00:00:00+01:00"}`), true)
	f.Add([]byte(`{"key":{"network":"n","containerID":"c","ifname":"eth0"},"netnsCookie":-1}`), false)
	f.Add([]byte(`null`), true)
	f.Add([]byte{}, false)
	f.Add([]byte("\xff\xfe{}"), true)

	f.Fuzz(func(t *testing.T, data []byte, ownName bool) {
		// The parser alone.
		path := filepath.Join(fastTempDir(t), "record.json")
		if err := os.WriteFile(path, data, fileMode); err != nil {
			t.Fatal(err)
		}
		rec, parseErr := readRecord(path)
		if parseErr == nil && (rec.Key.Network == "" || rec.Key.ContainerID == "" || rec.Key.Ifname == "") {
			t.Fatalf("accepted a record with an incomplete key: %+v", rec.Key)
		}

		// Open on a directory holding the bytes under a record's name, next to
		// an interrupted write.
		dir := fastTempDir(t)
		name := "0123456789abcdef0123456789abcdef" + recordSuffix
		if ownName && parseErr == nil {
			name = rec.Key.fileName()
		}
		if err := os.WriteFile(filepath.Join(dir, name), data, fileMode); err != nil {
			t.Fatal(err)
		}
		tmp := filepath.Join(dir, tempPrefix+name+"-123")
		if err := os.WriteFile(tmp, data, fileMode); err != nil {
			t.Fatal(err)
		}
		s, problems, err := Open(dir)
		if err != nil {
			t.Fatalf("Open failed on a record's content: %v", err)
		}
		if _, err := os.Stat(tmp); !os.IsNotExist(err) {
			t.Fatalf("interrupted write %s still there: %v", tmp, err)
		}
		loaded := parseErr == nil && name == rec.Key.fileName()
		_, asideErr := os.Stat(filepath.Join(dir, name+".corrupt"))
		if loaded {
			got, ok := s.Get(rec.Key)
			if len(problems) != 0 || !ok || s.Len() != 1 || !sameRecord(got, rec) || asideErr == nil {
				t.Fatalf("good record under its own name: problems %v, loaded %v (%d records), moved aside %v", problems, ok, s.Len(), asideErr == nil)
			}
		} else {
			if len(problems) == 0 || s.Len() != 0 || asideErr != nil {
				t.Fatalf("bad record (parse error %v, name %s): problems %v, %d records, moved aside: %v", parseErr, name, problems, s.Len(), asideErr)
			}
			for _, p := range problems {
				if !strings.Contains(p.Error(), filepath.Join(dir, name)) {
					t.Fatalf("problem does not say which file: %v", p)
				}
			}
			if err := os.Remove(filepath.Join(dir, name+".corrupt")); err != nil {
				t.Fatal(err)
			}
		}
		if parseErr != nil {
			return
		}

		// Round trip: Put, then what a restarted agent reads back.
		if err := s.Put(rec); err != nil {
			t.Fatalf("Put of an accepted record: %v", err)
		}
		again, problems, err := Open(dir)
		if err != nil || len(problems) != 0 {
			t.Fatalf("reopen: %v, problems %v", err, problems)
		}
		got, ok := again.Get(rec.Key)
		if !ok || again.Len() != 1 || !sameRecord(got, rec) {
			t.Fatalf("record changed across Put and Open:\n%+v\n%+v", rec, got)
		}
		if err := again.Delete(rec.Key); err != nil {
			t.Fatal(err)
		}
		if left, _ := os.ReadDir(dir); len(left) != 0 {
			t.Fatalf("files left after Delete: %v", left)
		}
	})
}
