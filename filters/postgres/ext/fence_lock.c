/*
 * The fence lock of the C install: a heavyweight lock per resource instead of a row lock.
 *
 * fence.sql's plpgsql guard and enforce() take the fence row FOR SHARE, and a raise's UPDATE waits
 * for them. A row lock writes: the first locker of a transaction dirties the row's page and logs
 * it, and a second concurrent locker turns the row's xmax into a MultiXact, which every later
 * locker expands and every lock check reads. With eight writers of one resource that was about
 * 13 % of the store's throughput (docs/BENCHMARKS.md). The C guard and enforce() take instead a
 * ShareLock on an object lock of the lock manager, named by fencegate.fences' OID and a hash of
 * the resource: shared memory only, and a backend that already holds it finds it in its own
 * table. The rule that makes it a fence:
 *
 *   every UPDATE or DELETE of a fence row takes the same lock in ExclusiveLock first
 *
 * enforced by the store, not by the callers: the C trigger fencegate.fence_write_lock() on
 * fencegate.fences (BEFORE UPDATE OR DELETE, FOR EACH ROW) takes it, so a raise (take_fence), an
 * operator's reset and any hand-written UPDATE all wait for the transactions that passed the C
 * guard, and no guard passes while one of them is in progress. A raise also still takes the row,
 * so the plpgsql guard's holders are waited for as before: both kinds of guard are fenced by both
 * kinds of writer, whichever install ran last.
 *
 * The fence is read after the lock is granted, under a new snapshot, not the statement's or the
 * transaction's: a raise that committed while we waited, or in REPEATABLE READ after our
 * snapshot, is seen and the token refused. The lock is not visible to SQL (object locks on a
 * table's OID are taken by nothing else), so no client can take it to hold a resource's raises.
 * A hash collision of two resources only makes their raises wait for each other's writers.
 */
#include "postgres.h"

#include "access/genam.h"
#include "access/htup_details.h"
#include "access/skey.h"
#include "access/stratnum.h"
#include "access/table.h"
#include "access/tableam.h"
#include "catalog/pg_trigger.h"
#include "commands/trigger.h"
#include "common/hashfn.h"
#include "executor/tuptable.h"
#include "fmgr.h"
#include "miscadmin.h"
#include "storage/lock.h"
#include "utils/builtins.h"
#include "utils/fmgroids.h"
#include "utils/rel.h"
#include "utils/snapmgr.h"

#include "fence_store.h"

PG_FUNCTION_INFO_V1(fencegate_fence_write_lock);

/* The trigger that makes every writer of a fence row take the lock (enforce_c.sql). */
#define WRITE_LOCK_TRIGGER "fence_write_lock"
/* Any fixed value: the hash only has to agree between the guard, enforce() and the trigger. */
#define FENCE_LOCK_SEED UINT64CONST(0x66656e63656c6f6b)

static void
fence_locktag(LOCKTAG *tag, Oid fences, const char *resource, size_t len)
{
	uint64		h = DatumGetUInt64(hash_any_extended((const unsigned char *) resource,
													 (int) len, FENCE_LOCK_SEED));

	SET_LOCKTAG_OBJECT(*tag, MyDatabaseId, fences, (uint32) h, (uint16) (h >> 32));
}

/*
 * The share lock means nothing without the trigger: an install that switched back to plpgsql
 * drops it, and a guard that was already running C code must not pass on a lock no writer takes.
 * Checked after the table is opened, so the relcache has seen a concurrent DROP TRIGGER.
 */
static void
require_write_lock_trigger(Relation rel)
{
	TriggerDesc *desc = rel->trigdesc;
	int			i;

	for (i = 0; desc != NULL && i < desc->numtriggers; i++)
	{
		Trigger    *trig = &desc->triggers[i];

		if (strcmp(trig->tgname, WRITE_LOCK_TRIGGER) == 0
			&& (trig->tgenabled == TRIGGER_FIRES_ON_ORIGIN
				|| trig->tgenabled == TRIGGER_FIRES_ALWAYS)
			&& TRIGGER_FOR_ROW(trig->tgtype) && TRIGGER_FOR_BEFORE(trig->tgtype)
			&& TRIGGER_FOR_UPDATE(trig->tgtype) && TRIGGER_FOR_DELETE(trig->tgtype))
			return;
	}
	ereport(ERROR,
			(errcode(ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE),
			 errmsg("fencegate: trigger %s on fencegate.fences is missing or does not fire for every session, so the C guard cannot fence",
					WRITE_LOCK_TRIGGER),
			 errhint("Run `fencegate postgres install --enforce c` again (or --enforce plpgsql).")));
}

bool
fencegate_share_fence(const char *resource, int64 revision, LockWaitPolicy wait, char **fence)
{
	Relation	rel;
	Relation	idx;
	Oid			pkey;
	AttrNumber	resource_att;
	AttrNumber	revision_att;
	TupleTableSlot *slot;
	IndexScanDesc scan;
	ScanKeyData key;
	LOCKTAG		tag;
	LockAcquireResult got;
	Snapshot	snap;
	bool		matched = false;
	bool		isnull = true;
	Datum		value = (Datum) 0;

	*fence = "";
	rel = table_open(fencegate_relid("fences"), RowShareLock);
	require_write_lock_trigger(rel);
	fence_locktag(&tag, RelationGetRelid(rel), resource, strlen(resource));
	got = LockAcquire(&tag, ShareLock, false, wait == LockWaitSkip);
	if (got == LOCKACQUIRE_NOT_AVAIL)
	{
		/* A writer of this fence row is in progress (a raise, most likely). */
		table_close(rel, NoLock);
		return false;
	}

	resource_att = fencegate_column(rel, "resource");
	revision_att = fencegate_column(rel, "revision");
	pkey = RelationGetPrimaryKeyIndex(rel);
	if (!OidIsValid(pkey))
		elog(ERROR, "fencegate: fencegate.fences has no primary key; run `fencegate postgres install` again");
	idx = index_open(pkey, RowShareLock);
	if (idx->rd_index->indnatts != 1 || idx->rd_index->indkey.values[0] != resource_att)
		elog(ERROR, "fencegate: the primary key of fencegate.fences is not (resource); run `fencegate postgres install` again");

	/* Taken after the lock was granted: sees every write of the row that finished before. */
	snap = RegisterSnapshot(GetLatestSnapshot());
	/* resource = $1 with the index's own collation, so the search follows the index's order. */
	ScanKeyEntryInitialize(&key, 0, 1, BTEqualStrategyNumber, InvalidOid,
						   idx->rd_indcollation[0], F_TEXTEQ, CStringGetTextDatum(resource));
	slot = table_slot_create(rel, NULL);
	scan = index_beginscan(rel, idx, snap, 1, 0);
	index_rescan(scan, &key, 1, NULL, 0);
	if (index_getnext_slot(scan, ForwardScanDirection, slot))
		value = slot_getattr(slot, revision_att, &isnull);
	matched = !isnull && DatumGetInt64(value) == revision;
	if (!matched && !isnull)
		*fence = psprintf(INT64_FORMAT, DatumGetInt64(value));
	index_endscan(scan);
	ExecDropSingleTupleTableSlot(slot);
	UnregisterSnapshot(snap);
	index_close(idx, NoLock);
	table_close(rel, NoLock);

	/*
	 * Not our fence: do not keep a lock taken for it here. The guard goes on to take_fence, which
	 * may raise the fence and so take the lock exclusively; two new holders each keeping a share
	 * lock there would deadlock.
	 */
	if (!matched && got == LOCKACQUIRE_OK)
		LockRelease(&tag, ShareLock, false);
	return matched;
}

/*
 * BEFORE UPDATE OR DELETE ON fencegate.fences FOR EACH ROW: the old row's fence lock, exclusive,
 * before the row changes; held to the end of the transaction. Waits (under lock_timeout) for
 * every transaction that passed the C guard for that resource.
 */
Datum
fencegate_fence_write_lock(PG_FUNCTION_ARGS)
{
	TriggerData *trigdata;
	Relation	rel;
	Datum		value;
	bool		isnull;
	LOCKTAG		tag;

	if (!CALLED_AS_TRIGGER(fcinfo))
		ereport(ERROR,
				(errcode(ERRCODE_E_R_I_E_TRIGGER_PROTOCOL_VIOLATED),
				 errmsg("fencegate.fence_write_lock() can only be called as a trigger")));
	trigdata = (TriggerData *) fcinfo->context;
	if (!TRIGGER_FIRED_BEFORE(trigdata->tg_event) || !TRIGGER_FIRED_FOR_ROW(trigdata->tg_event)
		|| !(TRIGGER_FIRED_BY_UPDATE(trigdata->tg_event)
			 || TRIGGER_FIRED_BY_DELETE(trigdata->tg_event)))
		ereport(ERROR,
				(errcode(ERRCODE_E_R_I_E_TRIGGER_PROTOCOL_VIOLATED),
				 errmsg("fencegate.fence_write_lock() must fire BEFORE UPDATE OR DELETE FOR EACH ROW")));
	rel = trigdata->tg_relation;
	value = heap_getattr(trigdata->tg_trigtuple, fencegate_column(rel, "resource"),
						 RelationGetDescr(rel), &isnull);
	if (!isnull)
	{
		text	   *resource = DatumGetTextPP(value);

		fence_locktag(&tag, RelationGetRelid(rel), VARDATA_ANY(resource),
					  VARSIZE_ANY_EXHDR(resource));
		(void) LockAcquire(&tag, ExclusiveLock, false, false);
	}
	return PointerGetDatum(TRIGGER_FIRED_BY_UPDATE(trigdata->tg_event)
						   ? trigdata->tg_newtuple : trigdata->tg_trigtuple);
}
